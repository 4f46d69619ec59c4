"""The frame of a comparison, written once for SFT (``check.parity``) and DPO (``check.dpo_parity``).

``compare`` runs a trainer's two sides (``Sides``: TRL's trainer + PEFT on torch's CPU, the GPU recipe; gemport's
step, the port) for the same steps from the same step-0 adapter in a temporary directory, then measures the floors
in the same run: the GPU recipe trained again, computing the same thing with other roundings (``Floor``). A side
is built by its trainer's ``prepare`` from a ``Setup`` (what the frame fixes: the base, the records, the tokenizer,
the dtype, GPU_OVERRIDES), everything the port needs checked before either side trains; the frame trains the GPU
recipe once per ``GpuRun``, the port once, and returns the trainer's ``Trajectory``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from gemport.check.adapters import distances, gpu_deltas
from gemport.check.verdict import LEAST_FLOOR, StepRow, Tolerances, Trajectory, step_floors, summed
from gemport.data import formats
from gemport.errors import GemportError, LoraError, RecipeError
from gemport.lora import QLoraSpec

GPU_OVERRIDES = dict(logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, bf16=False, fp16=False,
                     dataloader_num_workers=0, push_to_hub=False, eval_strategy="no")
"""What a comparison (SFT's and ``check.dpo_parity``'s) fixes on the GPU side whatever the recipe says: one process on
CPU, float32, a log line per step, nothing written, no evaluation (the training steps are compared; a recipe's
``eval_strategy: steps`` would make TRL ask for an eval split)."""


def peft_config(config, dropout=False):
    """A ``peft.LoraConfig`` of ``config``: a LoraConfig, a dict of its fields, or an ``adapter_config.json`` (or
    its directory). Raises ``RecipeError`` for ``lora_dropout`` > 0 unless ``dropout`` (``without_dropout``)."""
    import peft  # optional: the hf extra

    if isinstance(config, (str, Path)):
        path = Path(config)
        config = json.loads((path / "adapter_config.json" if path.is_dir() else path).read_text())
    if isinstance(config, Mapping):
        names = {f.name for f in dataclasses.fields(peft.LoraConfig)}
        config = peft.LoraConfig(**{k: v for k, v in config.items() if k in names and k != "peft_type"})
    if config.lora_dropout and not dropout:
        raise RecipeError(
            f"LoraConfig.lora_dropout={config.lora_dropout}: dropout draws random masks that differ between "
            "torch and JAX; compare with lora_dropout=0 (the rest of the recipe unchanged: without_dropout)"
        )
    return config


def without_dropout(lora_config):
    """(the ``peft.LoraConfig`` of ``lora_config`` (``peft_config``) with ``lora_dropout=0``, the dropout it had).

    A comparison goes step by step, which random masks would defeat: torch and JAX draw different ones.
    A recipe with dropout p is compared at p = 0, the rest unchanged, and says so; gemport's dropout at p
    (PEFT's rule: rate p on each adapted projection's LoRA input, kept values scaled by 1 / (1 - p), training
    only) is matched to PEFT in distribution by gemport's tests (mask rate and scaling, expected gradient).
    """
    given = peft_config(lora_config, dropout=True)
    config = copy.copy(given)
    config.lora_dropout = 0.0
    return config, given.lora_dropout


def dropout_note(p: float) -> str:
    """The line ``gemport parity`` prints for a recipe with LoRA dropout ``p`` > 0, compared at 0."""
    return (f"lora_dropout={p}: compared with lora_dropout=0 on both sides, the rest of the recipe unchanged "
            f"(dropout masks are random, and torch and JAX draw different ones). At lora_dropout={p} gemport drops "
            "out as PEFT does (rate p on each adapted projection's LoRA input, kept values scaled by 1/(1-p), in "
            "training only), tested against PEFT in distribution by gemport's tests, not by this run")


def logged_steps(log_history):
    """The training steps of an HF ``log_history`` (TRL's ``trainer.state``, or a ``trainer_state.json``'s): the
    entries with a loss and a grad_norm."""
    return [e for e in log_history if "loss" in e and "grad_norm" in e]


@dataclasses.dataclass(frozen=True)
class GpuRun:
    """One training of the GPU recipe: its attention kernel (``"eager"``, ``"sdpa"``) and its dtype.

    dtype: ``"float32"``; ``"bfloat16"``, the base in bfloat16 under torch's CPU bfloat16 autocast (``bf16``), as
    TRL trains a bf16 recipe on a GPU, PEFT's adapters float32; ``"float64"``, the base and adapters in float64
    inside ``TorchFloat64`` (every float32 step transformers asks for by name widened too: norms, RoPE, softmax,
    the loss), without gradient checkpointing (its recomputed forward runs in autograd's thread, outside the
    mode, and recomputes the same values) and with eager experts (torch's grouped matmul has no float64 kernel).
    """

    attention: str = "eager"
    dtype: str = "float32"

    @property
    def factor_dtype(self) -> str:
        """The dtype the LoRA factors train in: float64 in float64, else float32 (as PEFT creates them on a
        float32 or bfloat16 base)."""
        return "float64" if self.dtype == "float64" else "float32"

    def args(self, config):
        """``config`` (TRL's SFTConfig or DPOConfig) as this run trains it: a fresh copy, since a new
        TrainingArguments sets accelerate's process-wide state up again (mixed precision included: one set up for
        a run in the other dtype refuses to change)."""
        changes = {"bf16": self.dtype == "bfloat16"}
        if self.dtype == "float64":
            changes["gradient_checkpointing"] = False
        return dataclasses.replace(config, **changes)

    def precision(self):
        """The context the run trains in: ``TorchFloat64`` for float64, else none."""
        if self.dtype != "float64":
            return contextlib.nullcontext()
        from gemport._src.torch_float64 import TorchFloat64  # optional: imports torch

        return TorchFloat64()


class Floor(NamedTuple):
    """The GPU run a comparison's floors measure the first run against, and what the two compare (``name``)."""

    name: str
    run: GpuRun


FLOAT64 = Floor("TRL float64 vs float32", GpuRun("eager", "float64"))
"""A float32 recipe's floor: the recipe trained again from the same adapter on the same batches in float64. How
far the float32 run lands from it is the whole of its rounding error (attention, norms with large gains, the loss
over large logits, Adam's amplification of it), one draw of what the port's own float32 arithmetic adds. Eager vs
sdpa attention in float32 differ only in attention's roundings, a part of that error."""

BFLOAT16 = Floor("TRL float32 vs bfloat16 (autocast)", GpuRun("eager", "float32"))
"""A bfloat16 comparison's floor: the recipe trained again in float32, without the dtype's rounding, which the
port and TRL each add at different points of the computation (eager vs sdpa would differ in attention's rounding
only)."""

ATTENTION = Floor("TRL eager vs sdpa attention, float32", GpuRun("sdpa", "float32"))
"""A QLoRA recipe's floor: bitsandbytes quantizes 16- and 32-bit floats only, so there is no float64 run of a 4-bit
base; the narrower eager vs sdpa (attention's float32 rounding). Pass fixed loss and grad_norm bounds where that
is too narrow."""


def floor_for(dtype: str, qlora: QLoraSpec | None, who: str) -> Floor:
    """The floor of a comparison in ``dtype`` (``"float32"`` or ``"bfloat16"``), of a QLoRA recipe when ``qlora``.

    Raises:
      RecipeError: another dtype. LoraError: a QLoRA recipe in bfloat16 (its compute dtype is overridden).
    """
    if dtype not in ("float32", "bfloat16"):
        raise RecipeError(f"{who}: dtype {dtype!r}; compare in float32 or bfloat16")
    if dtype == "bfloat16":
        if qlora is not None:
            raise LoraError(f"{who}: a QLoRA recipe is compared in float32 (its compute dtype is overridden)")
        return BFLOAT16
    return FLOAT64 if qlora is None else ATTENTION


FLOOR_PADDING = 8
"""Padding columns added to every row of the port's second run (``Sides.port_again``), for the adapter floor: no
value changes in exact arithmetic, every contraction over tokens changes length."""


class Quantities(NamedTuple):
    """What a comparison takes from each step's log line besides the learning rate, and how their floors are
    measured.

    names: the logged quantities compared, loss and grad_norm among them.
    absolute: those judged by absolute difference (a share, such as DPO's ``rewards/accuracies``).
    kinds: groups whose floors are each the largest of the group at its step (rows that go through the same
    computation round alike, and one of them landing near the exact value by chance must not set the bound).
    sums: those that are sums over the step's tokens of terms of one sign (a loss, a log-probability): their
    floors are at least ``verdict.summed`` of the step's tokens; ``grad_norm`` (the square root of a sum over
    the trainable parameters) at least half of ``summed`` of the parameters.
    """

    names: tuple[str, ...] = ("loss", "grad_norm")
    absolute: tuple[str, ...] = ()
    kinds: tuple[tuple[str, ...], ...] = ()
    sums: tuple[str, ...] = ("loss",)

    def floors(self, logs, again, *, tokens: int, parameters: int):
        """Per step, {name: floor} of ``logs`` against ``again`` (``step_floors``), at least the rounding the
        arithmetic gives a sum over ``tokens`` (the most a step holds) or, for ``grad_norm``, over ``parameters``
        (the trainable ones), and raised to the largest of each kind.

        The measured distance is one draw of float32's rounding, which can land under a unit at a step where
        another correct order of the same sums lands several away (a first step's grad_norm); the arithmetic's
        bound does not depend on either run, so a port that computes something else is not hidden by it."""
        least = {"grad_norm": summed(parameters) / 2, **dict.fromkeys(self.sums, summed(tokens))}
        out = step_floors(logs, again, self.names, self.absolute, least)
        for floors in out:
            for kind in self.kinds:
                floors.update(dict.fromkeys(kind, max(floors[name] for name in kind)))
        return out


@dataclasses.dataclass(frozen=True)
class Setup:
    """What the frame fixes before a trainer's sides are built.

    base_dir: the HF checkpoint both sides load. records: the data, as TRL's dataset holds it. tokenizer: both
    sides'. work: the temporary directory (removed at the end). overrides: ``GPU_OVERRIDES``, with ``max_steps``
    when the steps are given. dtype: the first GPU run's and the port's, ``"float32"`` or ``"bfloat16"``.
    qlora: a QLoRA recipe's 4-bit base, computing in float32 as the rest of the comparison does.
    """

    base_dir: str | Path
    records: list
    tokenizer: Any
    work: Path
    overrides: Mapping
    dtype: str
    qlora: QLoraSpec | None

    @property
    def start(self) -> Path:
        """Where ``write_start`` writes the step-0 adapter (a PEFT adapter directory)."""
        return self.work / "adapter0"

    def base(self, run: GpuRun):
        """The HF model of ``base_dir`` as ``run`` loads it (a QLoRA recipe's through bitsandbytes)."""
        import torch  # optional: the hf extra
        import transformers  # optional: the hf extra

        quantization = transformers.BitsAndBytesConfig(**self.qlora.to_bnb()) if self.qlora is not None else None
        experts = {"experts_implementation": "eager"} if run.dtype == "float64" else {}
        return transformers.AutoModelForCausalLM.from_pretrained(
            self.base_dir, dtype=getattr(torch, run.dtype), attn_implementation=run.attention,
            quantization_config=quantization, **experts)

    def dataset(self):
        """The records as the GPU side's ``train_dataset``, fingerprinted by their JSON.

        datasets would fingerprint the table by pickling it with dill, which failed on the TPU machine (pyarrow's
        ``MonthDayNano`` type, with the pinned datasets and dill); the records' own hash names the same data.
        """
        import datasets  # optional: TRL's

        fingerprint = hashlib.sha256(json.dumps(self.records, sort_keys=True).encode()).hexdigest()[:16]
        return datasets.Dataset(datasets.table.InMemoryTable.from_pylist(self.records), fingerprint=fingerprint)

    def write_start(self, lora, seed: int) -> dict:
        """Write the step-0 adapter both sides start from to ``start``: PEFT's initialisation of ``lora`` (a
        ``peft.LoraConfig``) under ``torch.manual_seed(seed)`` on the base as the first GPU run loads it.

        Returns:
          Its factors, {PEFT parameter name: tensor}.
        """
        import peft  # optional: the hf extra
        import torch  # optional: the hf extra

        torch.manual_seed(seed)
        model = peft.get_peft_model(self.base(GpuRun("eager", self.dtype)), copy.deepcopy(lora))
        model.save_pretrained(self.start)
        return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


class PortRun(NamedTuple):
    """The port trained: its final adapters ({HF module: s*B@A}, ``adapters.port_deltas``) and, per step, a dict
    with its ``step``, ``learning_rate`` and the compared ``Quantities.names``."""

    deltas: dict
    logs: list


class Measured(NamedTuple):
    """What ``compare`` measured, for a trainer's ``Sides.trajectory``: the ``StepRow``s, each module's final
    adapter distance, the adapter floor and the floors' name (None where every bound is fixed), and per step the
    GPU side's log line, the port's (``PortRun.logs``) and the floors ({name: floor}; empty where not measured)."""

    rows: tuple
    adapters: dict
    adapter_floor: float | None
    floor_name: str | None
    gpu_logs: list
    port_logs: list
    floors: list


class Sides(Protocol):
    """A trainer's two sides over the frame, built by its ``prepare(setup)``: everything either side needs checked
    and the step-0 adapter written (``Setup.write_start``)."""

    quantities: Quantities

    def gpu_run(self, run: GpuRun) -> tuple[Any, list]:
        """Train the GPU recipe from the step-0 adapter as ``run`` says: (its PEFT model, TRL's log_history)."""

    def port_run(self) -> PortRun:
        """Train the port from the step-0 adapter."""

    def sizes(self) -> tuple[int, int]:
        """(tokens, parameters): the most tokens a step of the port holds, and its trainable parameters: what the
        compared sums run over (``Quantities.floors``)."""

    def port_again(self) -> PortRun | None:
        """The port trained again another correct way, for the adapter floor in float32, or None."""

    def trajectory(self, measured: Measured, tolerances: Tolerances) -> Trajectory:
        """The trainer's ``Trajectory`` of what ``compare`` measured."""


def _train(sides: Sides, run: GpuRun):
    with run.precision():
        model, history = sides.gpu_run(run)
    return model, logged_steps(history)


def compare(base_dir, data, prepare: Callable[[Setup], Sides], *, who: str, tokenizer=None, steps=None,
            dtype="float32", qlora=None, tolerances=Tolerances()) -> Trajectory:
    """Train a trainer's GPU recipe and its port from the same step-0 adapter, and the floors; its ``Trajectory``.

    Args:
      base_dir: an HF Gemma checkpoint (or a miniature of it) with its tokenizer, unless ``tokenizer`` is given.
      data: the trainer's TRL records or a file of them (``data.formats.read``).
      prepare: builds the trainer's ``Sides`` from the ``Setup``, checking everything before either side trains.
      who: the comparison's name in its errors.
      tokenizer: default ``AutoTokenizer.from_pretrained(base_dir)``.
      steps: the optimizer steps to compare (``max_steps``; default the recipe's).
      dtype: ``"float32"`` or ``"bfloat16"``; the floor follows (``floor_for``).
      qlora: a ``gemport.lora.QLoraSpec``: both sides on the 4-bit base, computing in float32.
      tolerances: ``Tolerances``; unless all are fixed, the GPU recipe trains again (``Floor.run``) and each step's
        quantities (``Sides.quantities``) get floors (``Quantities.floors``), and the final adapters the largest
        distance within the pairs of correct runs (the two GPU runs; in float32 also ``Sides.port_again``
        against the port), at least ``LEAST_FLOOR``.

    Returns:
      ``Sides.trajectory`` of the ``Measured`` steps.

    Raises:
      RecipeError, LoraError: the dtype (``floor_for``). GemportError: the GPU recipe logged no step, or the two
      sides logged different steps. What ``prepare`` checks, before either side trains.
    """
    import transformers  # optional: the hf extra

    floor = floor_for(dtype, qlora, who)
    records = list(formats.read(data)) if isinstance(data, (str, Path)) else list(data)
    with tempfile.TemporaryDirectory(prefix="gemport-parity-") as work:
        overrides = dict(GPU_OVERRIDES, **({} if steps is None else {"max_steps": steps}))
        setup = Setup(base_dir, records, tokenizer or transformers.AutoTokenizer.from_pretrained(base_dir),
                      Path(work), overrides, dtype,
                      None if qlora is None else dataclasses.replace(qlora, compute_dtype="float32"))
        sides = prepare(setup)
        model, logs = _train(sides, GpuRun("eager", dtype))
        if not logs:
            raise GemportError(f"{who}: the GPU recipe logged no step; is the data empty?")
        port = sides.port_run()
        if len(port.logs) != len(logs):
            raise GemportError(f"{who}: TRL logged {len(logs)} steps, the port {len(port.logs)}")
        gpu = gpu_deltas(model)
        adapters = distances(port.deltas, gpu)
        floors, adapter_floor, floor_name = [{}] * len(logs), None, None
        if None in (tolerances.loss, tolerances.grad_norm, tolerances.adapter):
            again, again_logs = _train(sides, floor.run)
            tokens, parameters = sides.sizes()
            floors = sides.quantities.floors(logs, again_logs, tokens=tokens, parameters=parameters)
            pairs = [distances(gpu_deltas(again), gpu)]
            other = sides.port_again() if dtype == "float32" and tolerances.adapter is None else None
            if other is not None:
                pairs.append(distances(other.deltas, gpu, port.deltas))
            adapter_floor = max(*(d for pair in pairs for d in pair.values()), LEAST_FLOOR)
            floor_name = floor.name
    rows = tuple(StepRow(p["step"], float(g["learning_rate"]), float(p["learning_rate"]), float(g["loss"]),
                         float(p["loss"]), float(g["grad_norm"]), float(p["grad_norm"]), f.get("loss"),
                         f.get("grad_norm"))
                 for g, p, f in zip(logs, port.logs, floors))
    return sides.trajectory(Measured(rows, adapters, adapter_floor, floor_name, logs, port.logs, floors), tolerances)


__all__ = ["ATTENTION", "BFLOAT16", "FLOAT64", "FLOOR_PADDING", "GPU_OVERRIDES", "Floor", "GpuRun", "Measured", "PortRun",
           "Quantities", "Setup", "Sides", "compare", "dropout_note", "floor_for", "logged_steps", "peft_config",
           "without_dropout"]
