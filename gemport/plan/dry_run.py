"""A recipe checked whole before renting: the step a run would take, compiled for its chips, against their HBM.

``dry_run(run)`` compiles the train step of an ``SFTRun`` (best built with ``SFTRun.create(..., abstract=True)``
from ``config.json`` alone, on a mesh of a TPU slice's compile-only devices) for its first step's micro-batch
shape, and reports per chip what XLA allocates, whether it fits and the step's FLOPs per token
(``gemport sft --config sft.yaml --dry-run [--tpu v5p-8]``). A ``DPORun``'s step is DPO's (its micro-batch the
chosen and rejected rows of each pair, the reference pass; ``gemport dpo --config dpo.yaml --dry-run``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from gemport.plan.compiled import compile_step
from gemport.plan.memory import HBM
from gemport.step.fit import described, does_not_fit, first_fitting, mesh_text, refused, to_fit

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class DryRun:
    """What one chip holds and computes for a run's train step, compiled.

    Attributes:
      argument_bytes, temp_bytes, peak_bytes: per chip, from XLA's memory analysis (arguments: the model, LoRA,
        optimizer state and micro-batch; temporaries: the step's activations, gradients and workspace; peak:
        arguments + outputs + temporaries, donated buffers once).
      hbm_bytes: the chip's HBM (``gemport.plan.HBM``), or None on a host whose memory gemport does not know.
      flops_per_token: the step's products' FLOPs (``gemport.plan.flops``: counted from its program, each loop
        times its trips, the remat's recomputation included), per token of the micro-batch (all chips).
      rows, seq_len: the micro-batch (all chips); mesh: the mesh's axis sizes; remat: the model's remat;
      platform: what compiled it ("tpu": libtpu; "cpu": XLA:CPU, bfloat16 computed in float32, an upper bound).
      batch_size: the recipe's ``per_device_train_batch_size`` (a DPO micro-batch has two rows per pair; None:
        ``rows``).
      choice: why ``remat``, where ``gradient_checkpointing`` chose it (``step.fit.described``); else empty.
      uncounted: products ``flops_per_token`` leaves out (``ProductFlops.uncounted``: on TPU, splash attention's
        "Pallas kernels").
    """

    argument_bytes: int
    temp_bytes: int
    peak_bytes: int
    hbm_bytes: int | None
    flops_per_token: float
    rows: int
    seq_len: int
    mesh: dict[str, int]
    remat: str
    platform: str
    batch_size: int | None = None
    choice: str = ""
    uncounted: frozenset[str] = frozenset()

    @property
    def fits(self) -> bool | None:
        """Whether the peak fits the chip's HBM; None when the HBM is unknown."""
        return None if self.hbm_bytes is None else self.peak_bytes <= self.hbm_bytes

    def advice(self) -> str:
        """What to change so that the step fits (empty when it fits or the HBM is unknown)."""
        if self.fits is not False:
            return ""
        return to_fit(self.remat, self.rows, self.seq_len, self.mesh, self.batch_size)

    def __str__(self) -> str:
        mesh = mesh_text(self.mesh)
        compiler = "libtpu" if self.platform == "tpu" else f"XLA:{self.platform.upper()}"
        compiler += f"; {self.choice}" if self.choice else ""
        text = (f"train step, {self.rows} rows x {self.seq_len} tokens per micro-batch on {mesh}, remat {self.remat} "
                f"({compiler}), per chip: arguments {self.argument_bytes / GiB:.2f} GiB, temporaries "
                f"{self.temp_bytes / GiB:.2f} GiB, peak {self.peak_bytes / GiB:.2f} GiB")
        if self.hbm_bytes is not None:
            text += f" of {self.hbm_bytes / GiB:.2f} GiB HBM: {'fits' if self.fits else 'does not fit'}"
        text += f"; {self.flops_per_token / 1e9:.3f} GFLOPs per token in products"
        text += f" ({', '.join(sorted(self.uncounted))} not counted)" if self.uncounted else ""
        return text + (f"\n{self.advice()}" if self.advice() else "")


# libtpu's device kinds ("TPU v5p", "TPU v5 lite", "TPU v6 lite", "TPU v4") -> HBM's chip names
_KINDS = {"tpuv4": "v4", "tpuv5p": "v5p", "tpuv5lite": "v5e", "tpuv5e": "v5e", "tpuv6lite": "v6e", "tpuv6e": "v6e"}


def _hbm(mesh) -> int | None:
    device = mesh.devices.flat[0]
    generation = _KINDS.get(device.device_kind.lower().replace(" ", "")) if device.platform == "tpu" else None
    return HBM.get(generation)


def dry_run(run: Any, *, hbm_bytes: int | None = None) -> DryRun:
    """Compile ``run``'s train step (``lower_step`` of ``run.make_trainer()``) for its first step's micro-batch on
    ``run.mesh``, never running it; nothing is written.

    run: an ``SFTRun`` or a ``DPORun`` (its step: chosen and rejected rows of each pair, the reference pass),
        abstract (``create(..., abstract=True)``: from ``config.json``, no weight read) or loaded. For a TPU
        slice, build it on ``make_mesh(spec, devices=slice_devices("v5p-8"), ...)``.
    hbm_bytes: the chip's HBM; default ``gemport.plan.HBM`` of the mesh's TPU generation (None on CPU).
    Returns a ``DryRun``.
    Raises BatchError when libtpu refuses to compile the step past the chips' HBM (RESOURCE_EXHAUSTED), naming the
    micro-batch, the mesh, libtpu's finding and what to change.
    """
    first = run.micro_batches(run.train_batches[:1])[0]  # the trainer's first micro-batch, its fields and shapes
    rows, seq_len = first["tokens"].shape
    trainer = run.make_trainer() if run.trainer is None else run.trainer
    remats = run.remats or (run.model.remat,)
    mesh, batch_size = dict(run.mesh.shape), run.args["per_device_train_batch_size"]
    try:  # as the trainer's first step chooses its remat (step.fit)
        compiled, remat, refusals = first_fitting(
            run.model, remats, lambda: compile_step(trainer, run.mesh, rows, seq_len, micro_batch=first))
    except jax.errors.JaxRuntimeError as e:
        # libtpu refuses to compile a program past the chip's HBM, so there is no peak to report: say what it
        # found and what to change.
        if not refused(e):
            raise
        raise does_not_fit(e, run.model.remat, rows, seq_len, mesh, batch_size) from None
    return DryRun(compiled.argument_bytes, compiled.temp_bytes, compiled.peak_bytes,
                  hbm_bytes if hbm_bytes is not None else _hbm(run.mesh), compiled.flops_per_token, rows, seq_len,
                  mesh, remat, run.mesh.devices.flat[0].platform, batch_size, described(remat, remats, refusals),
                  compiled.products.uncounted)


__all__ = ["DryRun", "dry_run"]
