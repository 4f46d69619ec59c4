"""Prove a DPO port before the TPU hours: TRL's ``DPOTrainer`` + PEFT and ``gemport dpo``'s step, step by step.

``trajectory`` runs N steps of a ``trl dpo`` recipe as the GPU side runs it (TRL's ``DPOTrainer`` given the
recipe's ``peft_config``, on torch's CPU) and as ``gemport dpo`` trains it (``run.DPORun``: ``DPOPeftTrainer``,
its ``trainer_state.json``), from the same step-0 adapter on the same pairs in the same order, both in float32,
and compares every step's learning rate, loss, grad_norm and TRL's DPO metrics (``step.METRICS``), and the final
adapters, each against a floor measured in the same run with ``gemport.check.parity``'s machinery: the GPU recipe
trained again with sdpa attention instead of eager (``parity.step_floors``, ``parity.FLOOR_MULTIPLE``).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from gemport.step.dpo import METRICS
from gemport.errors import GemportError, LoraError, MaskError, RecipeError, TemplateMismatchError
from gemport.check.adapters import adapter_distances
from gemport.check.parity import GPU_OVERRIDES, without_dropout
from gemport.check.verdict import FLOOR_MULTIPLE, LEAST_FLOOR, StepRow, Tolerances, Trajectory, step_floors

FLOORS = Tolerances(loss=None, grad_norm=None)
"""DPO parity's default: loss and grad_norm (and every DPO metric) held to ``FLOOR_MULTIPLE`` x their step's floor."""

ACCURACIES = "rewards/accuracies"
"""Judged by absolute difference: a share of pairs, equal on both sides unless TRL's own two runs differ."""


class MetricRow(NamedTuple):
    """One DPO metric of one step on both sides: TRL's logged value and gemport's, and the step's floor (None
    when not measured): how far the GPU recipe's second run logged it from the first, relative and at least
    ``LEAST_FLOOR``; for ``rewards/accuracies`` the absolute difference (0 when the runs agree)."""

    step: int
    name: str
    gpu: float
    port: float
    floor: float | None = None


def _distance(m: MetricRow) -> float:
    # Relative as parity's other quantities (|port - gpu| / |gpu|); absolute for a share of pairs.
    return abs(m.gpu - m.port) / (1.0 if m.name == ACCURACIES else max(abs(m.gpu), 1e-12)) if m.gpu != m.port else 0.0


@dataclasses.dataclass(frozen=True)
class DPOTrajectory(Trajectory):
    """A ``parity.Trajectory`` (learning rate, loss, grad_norm per step; final adapters) with TRL's DPO metrics
    per step (``metrics``: ``MetricRow``s, step by step in ``step.METRICS`` order), judged with the rest.

    A metric's bound: ``rewards/accuracies`` (a share of pairs) its floor, absolute: equal to TRL's unless TRL's
    own two runs differ; the others the fixed ``tolerances.loss`` when set, else ``FLOOR_MULTIPLE`` x the step's
    floor.
    """

    metrics: tuple = ()

    def metric_bound(self, m: MetricRow) -> float:
        """The bound on ``m``'s distance (relative; absolute for ``rewards/accuracies``)."""
        if m.name == ACCURACIES:
            return 0.0 if m.floor is None else m.floor
        if self.tolerances.loss is not None:
            return self.tolerances.loss
        if m.floor is None:
            raise GemportError(f"DPOTrajectory: no {m.name} tolerance: set Tolerances(loss=) or measure the floors")
        return FLOOR_MULTIPLE * m.floor

    def disagreements(self):
        """Every (step, quantity, gpu, port, distance, bound) beyond its bound: step by step (learning rate,
        loss, grad_norm, then the DPO metrics), then the final adapters."""
        found = super().disagreements()
        steps = [d for d in found if d[0] != "final"]
        steps += [(m.step, m.name, m.gpu, m.port, _distance(m), self.metric_bound(m)) for m in self.metrics
                  if not _distance(m) <= self.metric_bound(m)]
        order = {r.step: i for i, r in enumerate(self.rows)}
        return sorted(steps, key=lambda d: order[d[0]]) + [d for d in found if d[0] == "final"]

    def first_disagreement(self):
        """A sentence naming the first step and quantity that disagree (a DPO metric with its multiple of the
        floor), or None."""
        found = self.disagreements()
        if not found or found[0][1] not in METRICS:
            return super().first_disagreement()
        step, name, gpu, port, distance, bound = found[0]
        m = next(m for m in self.metrics if m.step == step and m.name == name)
        how = "absolute" if name == ACCURACIES else "relative"
        by = (f" = {distance / m.floor:.3g} x the floor {m.floor:.2g}" if m.floor and name != ACCURACIES
              and self.tolerances.loss is None else "")
        return f"step {step}: {name} {port:.6g} (port) vs {gpu:.6g} (GPU recipe), {how} {distance:.2e}{by} > {bound:.2g}"

    def table(self):
        """``Trajectory.table`` with a second table: each DPO metric per step on both sides, its distance and its
        multiple of the step's floor (for accuracies: the absolute difference)."""
        lines = super().table().splitlines()
        floors = all(m.floor is not None for m in self.metrics)
        extra = [f"{'step':>4} {'metric':<17} {'GPU':>12} {'port':>12} {'diff':>8}" + (" x floor" if floors else "")]
        for m in self.metrics:
            multiple = "" if not floors or m.name == ACCURACIES else f" {_distance(m) / m.floor:>7.2f}"
            extra.append(f"{m.step:>4} {m.name:<17} {m.gpu:>12.6g} {m.port:>12.6g} {_distance(m):>8.1e}{multiple}")
        return "\n".join(lines[:-1] + extra + lines[-1:])

    def _bounds(self):
        out = super()._bounds()
        if self.metrics:
            if self.tolerances.loss is not None:
                out.append(f"DPO metrics {self.tolerances.loss:.2g}")
            else:
                worst = max((_distance(m) / m.floor for m in self.metrics if m.name != ACCURACIES and m.floor),
                            default=0.0)
                out.append(f"DPO metrics {FLOOR_MULTIPLE:g} x the floor (at most {worst:.3g} x)")
            out.append(f"{ACCURACIES} equal" + (" (or within TRL's own two runs)" if any(
                m.floor for m in self.metrics if m.name == ACCURACIES) else ""))
        return out


def _by_kind(floors: dict[str, float | None]) -> dict[str, float | None]:
    # Each rewards/* (but accuracies) and logps/* floor raised to the largest of its kind at the step.
    out = dict(floors)
    for kind in ("rewards/", "logps/"):
        names = [n for n in METRICS if n.startswith(kind) and n != ACCURACIES and out.get(n) is not None]
        for n in names:
            out[n] = max(out[m] for m in names)
    return out


def conversations(record: Mapping[str, Any]) -> list:
    """The two conversations of a conversational preference record, as ``data.template.check_template`` reads
    them: prompt + chosen, prompt + rejected (chosen and rejected alone when the prompt is implicit), with the
    record's ``tools`` and ``chat_template_kwargs``; none for plain text (or a malformed record, which
    ``data.preferences`` names)."""
    if not isinstance(record, Mapping) or not all(isinstance(record.get(k), list) for k in ("chosen", "rejected")):
        return []
    extra = {k: record[k] for k in ("tools", "chat_template_kwargs") if k in record}
    return [{"messages": list(record.get("prompt") or []) + list(record[side]), **extra}
            for side in ("chosen", "rejected")]


def trajectory(base_dir, data, *, dpo_config, lora_config, steps=None, tokenizer=None, chat_format=None,
               port_dpo_config=None, tolerances=FLOORS, progress=True, qlora=None,
               dtype="float32") -> DPOTrajectory:
    """Run a ``trl dpo`` recipe with TRL and with ``gemport dpo``'s step for the same steps from the same step-0
    adapter; a ``DPOTrajectory``.

    base_dir: an HF Gemma checkpoint (or a miniature of it) with its tokenizer, unless ``tokenizer`` is given.
    data: TRL preference records (prompt/chosen/rejected or chosen/rejected, plain or conversational) or a file
        of them (``data.formats.read``). dpo_config: ``DPOConfig``, a dict of its fields, or a ``trl dpo
        --config`` YAML (``run.dpo.dpo_fields``); ``max_steps`` is set to ``steps`` when given; float32 on CPU,
        one log line per step and no checkpoints are imposed on both sides. lora_config: ``peft.LoraConfig``, a
        dict, or an ``adapter_config.json`` (or its directory). Its ``lora_dropout`` is turned off by TRL's
        ``disable_dropout`` (the default), on both sides; with ``disable_dropout: false`` it must be 0
        (``parity.without_dropout``: torch and JAX draw different masks).
    port_dpo_config: the port's DPOConfig if it differs (default: the same), e.g. to see a broken port.
    chat_format: the port's rendering of conversations (default: from the tokenizer's template, which must render
        the records' conversations as gemport does: ``data.template.check_template``).
    qlora: a ``gemport.lora.QLoraSpec`` (a QLoRA recipe): the GPU side loads ``base_dir`` through bitsandbytes
        (``BitsAndBytesConfig(**qlora.to_bnb())``), the port through ``load_qlora_model`` (``DPORun(qlora=)``),
        both computing in float32 as the rest of the comparison does, each reference being its 4-bit base with
        LoRA off. TRL's cast of a quantized model's adapters to bfloat16 is undone on the GPU side: the port
        trains float32 factors, as PEFT creates them (docs/qlora.md).
    dtype: ``"float32"`` (the default: a disagreement is in what is computed) or ``"bfloat16"``, the recipe as
        ``bf16: true`` trains it: TRL on a bfloat16 base under torch's CPU bfloat16 autocast (PEFT's adapters
        float32), the port on a bfloat16 base with float32 factors, as ``gemport dpo`` trains it; the floor is
        then TRL's own float32 run against its bfloat16 one (``gemport.check.parity.trajectory``'s bfloat16 floor).

    The step-0 adapter is PEFT's initialisation of ``lora_config`` under ``torch.manual_seed(seed)``. The GPU side
    is TRL's ``DPOTrainer`` given the base and the recipe's ``peft_config`` (the reference: the adapter disabled),
    its adapter set to the step-0 one; the port is ``run.DPORun`` from that adapter with the base as reference,
    trained by ``DPORun.train`` (``DPOPeftTrainer``) on one device, its values read from the
    ``trainer_state.json`` it writes, as ``gemport dpo`` does. Everything the port needs (recipe fields, loss,
    optimizer, LoRA config, tokenizer and template, data, token ids) is checked, and the port's model loaded,
    before either side trains. Unless the tolerances fix all, the GPU side trains again with sdpa attention
    instead of eager: each step's loss, grad_norm and DPO metrics are held to ``FLOOR_MULTIPLE`` times how far
    that run logged them from the first (``parity.step_floors``), the final adapters to ``FLOOR_MULTIPLE`` times
    how far the two end apart, and at least ``parity.LEAST_ADAPTER_TOLERANCE``.

    A DPO metric's floor is the largest of its kind at its step (``rewards/*`` but accuracies, ``logps/*``): the
    chosen and rejected rows go through the same computation and round alike, and one of them landing near the
    exact value by chance (its roundings cancelling) does not set the bound.

    Raises RecipeError (recipe fields, no steps, a dtype other than float32 or bfloat16), LoraError (also a QLoRA
    recipe in bfloat16), MaskError / TemplateMismatchError (data, template), OptimizerConfigError, before either
    side trains.
    """
    import datasets
    import jax
    import jax.numpy as jnp
    import peft
    import torch
    import transformers
    from trl import DPOConfig, DPOTrainer

    from gemport.run.dpo import DPORun, dpo_fields
    from gemport.lora import LoraSpec
    from gemport.data import formats
    from gemport.data.template import chat_format as template_format
    from gemport.data.template import check_template
    from gemport.mesh import make_mesh
    from gemport.specs import GemmaSpec

    if dtype not in ("float32", "bfloat16"):
        raise RecipeError(f"dpo parity: dtype {dtype!r}; compare in float32 or bfloat16")
    bf16 = dtype == "bfloat16"
    if bf16 and qlora is not None:
        raise LoraError("dpo parity: a QLoRA recipe is compared in float32 (its compute dtype is overridden)")
    records = list(formats.read(data)) if isinstance(data, (str, Path)) else list(data)
    lora, dropout = without_dropout(lora_config)
    with tempfile.TemporaryDirectory(prefix="gemport-dpo-parity-") as work:
        work = Path(work)
        overrides = dict(GPU_OVERRIDES, **({} if steps is None else {"max_steps": steps}))
        gpu_args = {**dpo_fields(dpo_config), **overrides, "output_dir": str(work / "trl")}
        port_args = {**dpo_fields(port_dpo_config if port_dpo_config is not None else dpo_config), **overrides,
                     "output_dir": str(work / "port"), "disable_tqdm": not progress}
        if not gpu_args["max_steps"] or gpu_args["max_steps"] <= 0:
            raise RecipeError("dpo parity: set max_steps in the recipe or pass steps=")
        if dropout and not gpu_args["disable_dropout"]:
            raise RecipeError(f"LoraConfig.lora_dropout={dropout} with disable_dropout=False: dropout draws random "
                              "masks that differ between torch and JAX; compare with lora_dropout=0 "
                              "(parity.without_dropout)")
        # Checked before either side trains: TRL's own reading of the recipe, the port's LoRA config, the template
        # against the conversations, then everything DPORun.create checks (fields, loss, optimizer, data, ids).
        gpu_config = DPOConfig(**{k: v for k, v in gpu_args.items() if k in {f.name for f in dataclasses.fields(
            DPOConfig) if f.init}})
        spec = GemmaSpec.from_hf(base_dir)
        LoraSpec.from_peft(lora)
        tokenizer = tokenizer or transformers.AutoTokenizer.from_pretrained(base_dir)
        if not records:
            raise MaskError(f"{data if isinstance(data, (str, Path)) else 'data'}: no preference record")
        for i, record in enumerate(records):
            if conversations(record):
                chat_format = chat_format or template_format(tokenizer)
                try:
                    check_template(tokenizer, chat_format, conversations(record), on_mismatch="raise")
                except TemplateMismatchError as e:
                    raise TemplateMismatchError(f"records[{i}]: {e} (conversation 0 is prompt + chosen, 1 prompt + "
                                                "rejected)") from None

        if qlora is not None:
            qlora = dataclasses.replace(qlora, compute_dtype="float32")
        quantization = transformers.BitsAndBytesConfig(**qlora.to_bnb()) if qlora is not None else None

        def base_model(attention, dtype=torch.float32):
            return transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype,
                                                                     attn_implementation=attention,
                                                                     quantization_config=quantization)

        torch.manual_seed(gpu_args["seed"])
        start = peft.get_peft_model(base_model("eager"), copy.deepcopy(lora))
        start.save_pretrained(work / "adapter0")
        factors = {n: p.detach().clone() for n, p in start.named_parameters() if "lora_" in n}
        del start
        mesh = make_mesh(spec, fsdp=1, tp=1, devices=jax.devices()[:1])  # one device, as on a GPU
        port = DPORun.create(port_args, base_dir, records, init_adapter=work / "adapter0", reference="base",
                             mesh=mesh, dtype=jnp.bfloat16 if bf16 else jnp.float32, qlora=qlora,
                             tokenizer=tokenizer, chat_format=chat_format, progress=progress)

        def gpu_run(attention, bf16=False):
            # A fresh DPOConfig sets accelerate's process-wide state up again, its mixed precision included.
            torch.manual_seed(gpu_args["seed"])
            trainer = DPOTrainer(model=base_model(attention, torch.bfloat16 if bf16 else torch.float32),
                                 args=dataclasses.replace(gpu_config, bf16=bf16),
                                 train_dataset=datasets.Dataset.from_list(records), processing_class=tokenizer,
                                 peft_config=copy.deepcopy(lora))
            for name, p in trainer.model.named_parameters():  # the step-0 adapter, as the port starts from it
                if "lora_" in name:
                    # Assigned, not copied: TRL casts a quantized model's adapters to bfloat16, and the port's
                    # (as PEFT creates them) are float32.
                    p.data = factors[name].clone()
            trainer.train()
            return trainer.model, [e for e in trainer.state.log_history if "loss" in e and "grad_norm" in e]

        model, logs = gpu_run("eager", bf16)
        port.train()
        state = json.loads((work / "port" / "trainer_state.json").read_text())
        port_logs = [e for e in state["log_history"] if "loss" in e and "grad_norm" in e]
        if len(port_logs) != len(logs) or not logs:
            raise GemportError(f"dpo parity: TRL logged {len(logs)} steps, the port {len(port_logs)}")
        adapters = adapter_distances(port.model, model, spec, port.lora_spec)
        names = ("loss", "grad_norm", *METRICS)
        floors, floor, floor_name = [dict.fromkeys(names)] * len(logs), None, None
        if None in (tolerances.loss, tolerances.grad_norm, tolerances.adapter):
            # bfloat16: the recipe trained again in float32, without the dtype's rounding, which the port and TRL
            # each add at different points; float32: another correct attention kernel.
            floor_name = "TRL float32 vs bfloat16 (autocast)" if bf16 else "TRL eager vs sdpa attention, float32"
            again, again_logs = gpu_run("eager") if bf16 else gpu_run("sdpa")
            floors = [_by_kind(f) for f in step_floors(logs, again_logs, names, absolute=(ACCURACIES,))]
            floor = max(*adapter_distances(again, model).values(), LEAST_FLOOR)
    steps_of = [s.step for s in port.plan]
    rows = tuple(StepRow(s, float(g["learning_rate"]), float(p["learning_rate"]), float(g["loss"]), float(p["loss"]),
                         float(g["grad_norm"]), float(p["grad_norm"]), f["loss"], f["grad_norm"])
                 for s, g, p, f in zip(steps_of, logs, port_logs, floors))
    metrics = tuple(MetricRow(s, k, float(g[k]), float(p[k]), f[k])
                    for s, g, p, f in zip(steps_of, logs, port_logs, floors) for k in METRICS)
    return DPOTrajectory(rows, tolerances, adapters, floor, floor_name, metrics=metrics)


__all__ = ["ACCURACIES", "DPOTrajectory", "FLOORS", "MetricRow", "conversations", "trajectory"]
