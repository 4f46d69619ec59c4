"""Prove a DPO port before the TPU hours: TRL's ``DPOTrainer`` + PEFT and ``gemport dpo``'s step, step by step.

``trajectory`` runs N steps of a ``trl dpo`` recipe as the GPU side runs it (TRL's ``DPOTrainer`` given the
recipe's ``peft_config``, on torch's CPU) and as ``gemport dpo`` trains it (``run.DPORun``: ``DPOPeftTrainer``,
its ``trainer_state.json``), from the same step-0 adapter on the same pairs in the same order, both in float32,
and compares every step's learning rate, loss, grad_norm and TRL's DPO metrics (``step.METRICS``), and the final
adapters, each against a floor measured in the same run by ``check.frame``, as SFT's comparison
(``check.parity``) measures it: the GPU recipe trained again in float64 (``frame.FLOAT64``), whose distance from
the float32 run is all of float32's rounding.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gemport.check.adapters import port_deltas
from gemport.check.frame import FLOOR_PADDING, PortRun, Quantities, Setup, compare, logged_steps, without_dropout
from gemport.check.verdict import FLOOR_MULTIPLE, Tolerances, Trajectory
from gemport.data.template import chat_format as template_format
from gemport.data.template import check_template
from gemport.errors import GemportError, MaskError, RecipeError, TemplateMismatchError
from gemport.lora import LoraSpec
from gemport.mesh import make_mesh
from gemport.run.dpo import DPORun, dpo_fields
from gemport.run.outputs import TRAINER_STATE
from gemport.specs import GemmaSpec
from gemport.step.dpo import METRICS

FLOORS = Tolerances(loss=None, grad_norm=None)
"""DPO parity's default: loss and grad_norm (and every DPO metric) held to ``FLOOR_MULTIPLE`` x their step's floor."""

ACCURACIES = "rewards/accuracies"
"""Judged by absolute difference: a share of pairs, equal on both sides unless TRL's own two runs differ."""

QUANTITIES = Quantities(("loss", "grad_norm", *METRICS), absolute=(ACCURACIES,), kinds=tuple(
    tuple(n for n in METRICS if n.startswith(kind) and n != ACCURACIES) for kind in ("rewards/", "logps/")),
    sums=tuple(n for n in METRICS if n.startswith("logps/")))
"""What DPO's comparison judges each step, and each DPO metric's floor the largest of its kind at its step
(``rewards/*`` but accuracies, ``logps/*``): the chosen and rejected rows go through the same computation and round
alike, and one of them landing near the exact value by chance (its roundings cancelling) does not set the bound.
The log-probabilities are sums over the completions' tokens; the loss is a function of their differences, whose
rounding the measured floors carry."""


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



@dataclasses.dataclass(frozen=True)
class _DPOSides:
    """DPO's sides over ``frame.compare``: TRL's ``DPOTrainer`` given the base and the recipe's ``peft_config``
    (the reference: the adapter disabled), its adapter set to the step-0 one; and ``run.DPORun`` from that adapter
    with the base as reference, on one device.

    config: the GPU side's DPOConfig. lora: the recipe's ``peft.LoraConfig``. factors: the step-0 adapter's, by
    PEFT parameter name. port: the port's run, built (everything it needs checked) and not yet trained. again: how
    to build it once more (``port_again``), as ``port`` was but for its fields' changes.
    """

    setup: Setup
    config: Any
    lora: Any
    factors: dict
    spec: GemmaSpec
    port: DPORun
    again: Any
    quantities: Quantities = QUANTITIES

    @classmethod
    def prepare(cls, setup: Setup, *, data, dpo_config, lora_config, port_dpo_config, chat_format,
                progress) -> _DPOSides:
        """Check the recipe (TRL's own reading too), the LoRA config, the template against the conversations and
        everything ``DPORun.create`` checks (fields, loss, optimizer, data, ids), write the step-0 adapter and
        build the port (``trajectory``'s arguments)."""
        from trl import DPOConfig  # optional: the trl extra

        lora, dropout = without_dropout(lora_config)
        gpu_args = {**dpo_fields(dpo_config), **setup.overrides, "output_dir": str(setup.work / "trl")}
        port_args = {**dpo_fields(port_dpo_config if port_dpo_config is not None else dpo_config), **setup.overrides,
                     "output_dir": str(setup.work / "port"), "disable_tqdm": not progress}
        if not gpu_args["max_steps"] or gpu_args["max_steps"] <= 0:
            raise RecipeError("dpo parity: set max_steps in the recipe or pass steps=")
        if dropout and not gpu_args["disable_dropout"]:
            raise RecipeError(f"LoraConfig.lora_dropout={dropout} with disable_dropout=False: dropout draws random "
                              "masks that differ between torch and JAX; compare with lora_dropout=0 "
                              "(parity.without_dropout)")
        config = DPOConfig(**{k: v for k, v in gpu_args.items() if k in {f.name for f in dataclasses.fields(
            DPOConfig) if f.init}})
        spec = GemmaSpec.from_hf(setup.base_dir)
        LoraSpec.from_peft(lora)
        if not setup.records:
            raise MaskError(f"{data if isinstance(data, (str, Path)) else 'data'}: no preference record")
        for i, record in enumerate(setup.records):
            if conversations(record):
                chat_format = chat_format or template_format(setup.tokenizer)
                try:
                    check_template(setup.tokenizer, chat_format, conversations(record), on_mismatch="raise")
                except TemplateMismatchError as e:
                    raise TemplateMismatchError(f"records[{i}]: {e} (conversation 0 is prompt + chosen, 1 prompt + "
                                                "rejected)") from None
        factors = setup.write_start(lora, config.seed)
        mesh = make_mesh(spec, fsdp=1, tp=1, devices=jax.devices()[:1])  # one device, as on a GPU
        def port(**changes):
            return DPORun.create({**port_args, **changes}, setup.base_dir, setup.records, init_adapter=setup.start,
                                 reference="base", mesh=mesh,
                                 dtype=jnp.bfloat16 if setup.dtype == "bfloat16" else jnp.float32,
                                 qlora=setup.qlora, tokenizer=setup.tokenizer, chat_format=chat_format,
                                 progress=progress)

        return cls(setup, config, lora, factors, spec, port(), port)

    def gpu_run(self, run):
        import torch  # optional: the hf extra
        from trl import DPOTrainer  # optional: the trl extra

        torch.manual_seed(self.config.seed)
        trainer = DPOTrainer(model=self.setup.base(run), args=run.args(self.config),
                             train_dataset=self.setup.dataset(), processing_class=self.setup.tokenizer,
                             peft_config=copy.deepcopy(self.lora))
        for name, p in trainer.model.named_parameters():  # the step-0 adapter, as the port starts from it
            if "lora_" in name:
                # Assigned in the run's factor dtype: TRL casts a quantized model's adapters to bfloat16, and the
                # port's (as PEFT creates them) are float32.
                p.data = self.factors[name].to(getattr(torch, run.factor_dtype), copy=True)
        trainer.train()
        return trainer.model, trainer.state.log_history

    def sizes(self):
        tokens = max(int(np.size(batch["tokens"])) for batch in self.port.train_batches)
        lora = nnx.state(self.port.model, nnx.LoRAParam)
        return tokens, sum(int(np.size(v)) for v in jax.tree.leaves(lora))

    def port_run(self):
        return self._trained(self.port)

    def port_again(self):
        """The port with ``FLOOR_PADDING`` more padding columns per row (``pad_to_multiple_of`` past its width: no
        target, seen by no real token; every contraction over tokens changes length)."""
        width = self.port.train_batches[0]["tokens"].shape[-1]
        return self._trained(self.again(pad_to_multiple_of=width + FLOOR_PADDING,
                                        output_dir=str(self.setup.work / "port-again")))

    def _trained(self, port):
        port.train()
        state = json.loads((Path(port.fields.output_dir) / TRAINER_STATE).read_text())
        logs = [dict(e, step=s.step) for s, e in zip(port.plan, logged_steps(state["log_history"]))]
        return PortRun(port_deltas(port.model, self.spec, port.lora_spec), logs)

    def trajectory(self, measured, tolerances):
        metrics = tuple(MetricRow(p["step"], k, float(g[k]), float(p[k]), f.get(k))
                        for g, p, f in zip(measured.gpu_logs, measured.port_logs, measured.floors) for k in METRICS)
        return DPOTrajectory(measured.rows, tolerances, measured.adapters, measured.adapter_floor,
                             measured.floor_name, metrics=metrics)


def trajectory(base_dir, data, *, dpo_config, lora_config, steps=None, tokenizer=None, chat_format=None,
               port_dpo_config=None, tolerances=FLOORS, progress=True, qlora=None,
               dtype="float32") -> DPOTrajectory:
    """Run a ``trl dpo`` recipe with TRL and with ``gemport dpo``'s step for the same steps from the same step-0
    adapter; a ``DPOTrajectory``.

    The step-0 adapter is PEFT's initialisation of ``lora_config`` under ``torch.manual_seed(seed)``. The GPU side
    is TRL's ``DPOTrainer`` with the recipe's ``peft_config`` (the reference: the adapter disabled); the port is
    ``run.DPORun`` from that adapter, trained by ``DPORun.train`` on one device, its values read from the
    ``trainer_state.json`` it writes. Each step's loss, grad_norm and DPO metrics, and the final adapters, are held
    to ``FLOOR_MULTIPLE`` times floors measured in the same run (``parity.step_floors``; a metric's floor is the
    largest of its kind at its step, ``QUANTITIES``); see docs/dpo.md#prove-the-port-gemport-parity-for-dpo.

    Args:
      base_dir: an HF Gemma checkpoint (or a miniature of it) with its tokenizer, unless ``tokenizer`` is given.
      data: TRL preference records (prompt/chosen/rejected or chosen/rejected, plain or conversational) or a file
        of them (``data.formats.read``).
      dpo_config: ``DPOConfig``, a dict of its fields, or a ``trl dpo --config`` YAML (``run.dpo.dpo_fields``);
        ``max_steps`` is set to ``steps`` when given; float32 on CPU, one log line per step and no checkpoints
        are imposed on both sides.
      lora_config: ``peft.LoraConfig``, a dict, or an ``adapter_config.json`` (or its directory). Its
        ``lora_dropout`` is turned off by TRL's ``disable_dropout`` (the default), on both sides; with
        ``disable_dropout: false`` it must be 0 (``parity.without_dropout``).
      steps: the optimizer steps to compare (default: the config's ``max_steps``).
      tokenizer: default ``AutoTokenizer.from_pretrained(base_dir)``.
      chat_format: the port's rendering of conversations (default: from the tokenizer's template, which must
        render the records' conversations as gemport does: ``data.template.check_template``).
      port_dpo_config: the port's DPOConfig if it differs (default: the same), e.g. to see a broken port.
      tolerances: the bounds (default ``FLOORS``: measured floors).
      progress: show the port's steps as a progress bar.
      qlora: a ``gemport.lora.QLoraSpec``: bitsandbytes' 4-bit base on TRL's side, ``load_qlora_model`` on the
        port's (``DPORun(qlora=)``), both in float32, each reference its 4-bit base with LoRA off.
      dtype: ``"float32"`` (the default: a disagreement is in what is computed) or ``"bfloat16"``, the recipe as
        ``bf16: true`` trains it, judged against TRL's own float32 run (``frame.BFLOAT16``).

    Returns:
      A ``DPOTrajectory``: a ``parity.Trajectory`` with ``metrics`` (``MetricRow``s), ``ok`` and
      ``first_disagreement``.

    Raises:
      RecipeError: recipe fields, no steps, a dtype other than float32 or bfloat16.
      LoraError: the LoRA config, or a QLoRA recipe in bfloat16.
      MaskError, TemplateMismatchError: the data or the template.
      OptimizerConfigError: the optimizer fields. All before either side trains.
    """
    return compare(base_dir, data, functools.partial(
        _DPOSides.prepare, data=data, dpo_config=dpo_config, lora_config=lora_config, port_dpo_config=port_dpo_config,
        chat_format=chat_format, progress=progress),
        who="dpo parity", tokenizer=tokenizer, steps=steps, dtype=dtype, qlora=qlora, tolerances=tolerances)


__all__ = ["ACCURACIES", "DPOTrajectory", "FLOORS", "MetricRow", "conversations", "trajectory"]
