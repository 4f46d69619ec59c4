"""Memory plans: what each device holds (params, LoRA params, Adam moments, a train step) on an (fsdp, tp) mesh,
estimated without compiling (``gemport.plan.compiled`` compiles the step itself)."""

from __future__ import annotations

import dataclasses

import numpy as np

from gemport.errors import MeshError
from gemport.plan.activations import StepMemory, step_memory
from gemport.mesh.dims import FSDP, TP, annotated
from gemport.mesh.factory import check, valid_tp
from gemport.lora import LoraLayout, LoraSpec, QLoraSpec
from gemport.lora.config import FACTOR_DTYPE
from gemport.lora.qlora import bytes_per_device as qlora_bytes_per_device
from gemport.lora.qlora import is_quantized
from gemport._src.partition import axes_of, bytes_per_device
from gemport.specs import GemmaSpec
from gemport.step.hf import LossFn, segment_loss, tunix_loss
from gemport.step.chunked_loss import VOCAB_SLICE, num_slices
from gemport.step.scan import scanned_period

GiB = 2**30

# HBM per chip (one JAX device), from Google Cloud's TPU system architecture pages.
HBM = {"v4": 32 * GiB, "v5e": 16 * GiB, "v5p": 95 * GiB, "v6e": 32 * GiB}

@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes each device holds for one (fsdp, tp) mesh, before activations.

    Attributes:
      fsdp: the mesh's fsdp size.
      tp: the mesh's tp size.
      base_bytes: the model's params under Tunix's annotations.
      lora_bytes: lora_a and lora_b of every target module (0 for full fine-tuning).
      optimizer_bytes: Adam's mu and nu for the trainable params (LoRA, or all params without LoRA).
      hbm_bytes: HBM per device, if given.
      step: gradients, activations, logits, the batch and (under fsdp) the gathered weights of one train step
        (``gemport.plan.activations``),
        when the plan was given ``batch`` and ``seq_len``; None otherwise, and then the plan says so.
      weight_copy_bytes: on ``backend="cpu"``, the copies XLA:CPU makes of weights for its dots (0 otherwise):
        the transposed largest attention weight (and, for Tunix's step, the transposed embedding; for the
        fast step on a bfloat16 embedding, the 16-bit view it slices).
      tunix_step, tunix_weight_copy_bytes: the same for Tunix's own step (its attention's [B, T, N, S] scores
        and [B, T, V] logits), the baseline ``bench/`` compares the segment step against; None without a batch.
    """

    fsdp: int
    tp: int
    base_bytes: int
    lora_bytes: int
    optimizer_bytes: int
    hbm_bytes: int | None = None
    step: StepMemory | None = None
    weight_copy_bytes: int = 0
    tunix_step: StepMemory | None = None
    tunix_weight_copy_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        step = self.step.total_bytes + self.weight_copy_bytes if self.step else 0
        return self.base_bytes + self.lora_bytes + self.optimizer_bytes + step

    @property
    def tunix_total_bytes(self) -> int | None:
        """``total_bytes`` with Tunix's own step in place of ``step``; None without a batch."""
        if self.tunix_step is None:
            return None
        return (self.base_bytes + self.lora_bytes + self.optimizer_bytes + self.tunix_step.total_bytes
                + self.tunix_weight_copy_bytes)

    @property
    def fits(self) -> bool | None:
        """Whether ``total_bytes`` fits ``hbm_bytes``. None without ``hbm_bytes``, and None when the state fits
        but the train step (gradients, activations) was not planned: that needs ``batch`` and ``seq_len``."""
        if self.hbm_bytes is None:
            return None
        if self.total_bytes > self.hbm_bytes:
            return False
        return True if self.step else None

    def __str__(self):
        step = self.step
        text = (
            f"fsdp={self.fsdp} tp={self.tp}: base {_human(self.base_bytes)} + LoRA {_human(self.lora_bytes)} + "
            f"Adam mu,nu {_human(self.optimizer_bytes)}"
        )
        if step:
            text += (
                f" + gradients {_human(step.gradient_bytes)} + activations {_human(step.activation_bytes)} + "
                f"logits and loss {_human(step.logits_bytes)} + batch {_human(step.batch_bytes)}"
                + (f" + fsdp-gathered weights {_human(step.gathered_bytes)}" if step.gathered_bytes else "")
                + (f" + a scanned block's weights {_human(step.scanned_bytes)}" if step.scanned_bytes else "")
                + (f" + XLA:CPU weight copy {_human(self.weight_copy_bytes)}" if self.weight_copy_bytes else "")
                + f" = {_human(self.total_bytes)} per device (batch {step.batch} x {step.seq_len} tokens, "
                f"remat {step.remat}, {'fast' if step.loss_fn is segment_loss else 'Tunix'} step)"
            )
        else:
            text += f" = {_human(self.total_bytes)} per device before the train step (no batch/seq_len given)"
        if self.hbm_bytes is None:
            return text
        verdict = {True: "fits", False: "does not fit", None: "state fits; plan a batch to know if the step does"}
        text += f" of {_human(self.hbm_bytes)}: " + verdict[self.fits]
        return text

    @property
    def tunix_line(self) -> str | None:
        """What Tunix's own step would need on this mesh, one line; None without a batch or when planned."""
        if self.tunix_step is None or self.step is self.tunix_step:
            return None
        return f"Tunix's own step (its attention's scores, [B, T, V] logits) would need {_human(self.tunix_total_bytes)}"


def _human(nbytes: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def _hbm(hbm_bytes: int | str | None) -> int | None:
    if isinstance(hbm_bytes, str):
        try:
            return HBM[hbm_bytes]
        except KeyError:
            raise MeshError(f"unknown chip {hbm_bytes!r}; known: {', '.join(HBM)}; or pass bytes") from None
    return hbm_bytes


def memory_plan(
    spec: GemmaSpec,
    fsdp: int,
    tp: int,
    *,
    lora_spec: LoraSpec | None = None,
    hbm_bytes: int | str | None = None,
    param_dtype="bfloat16",
    lora_dtype=None,
    moments_dtype=None,
    batch: int | None = None,
    seq_len: int | None = None,
    remat: str = "none",
    compute_dtype=None,
    backend: str = "tpu",
    qlora: QLoraSpec | None = None,
    loss_fn: LossFn = segment_loss,
) -> MemoryPlan:
    """Per-device bytes of params, LoRA params and Adam moments on an (fsdp, tp) mesh.

    Every array counts ``prod(shape) / prod(sizes of the axes its spec shards)`` elements: base params with their
    Tunix annotations, LoRA factors as ``LoraLayout(spec, lora_spec)`` shapes them in ``FACTOR_DTYPE``, Adam's mu
    and nu like the trainable params in ``moments_dtype``. See docs/mesh.md#the-memory-plan.

    Args:
      lora_spec: the LoRA config (targets, rank, per-module ranks, fused form); None plans full fine-tuning
        (moments for every param, no LoRA).
      hbm_bytes: HBM per device in bytes, or a chip name from ``HBM`` (e.g. ``"v5p"``).
      batch, seq_len: rows per step (all devices) and tokens per row; with both, the plan adds the train
        step's gradients, activations (per ``remat``: ``"none"``, ``"block"``, ``"decoder"``, Tunix's
        ``remat_config``, or ``"projections"``, ``step.remat.SAVED``), logits and loss temporaries
        (``gemport.plan.activations.step_memory``) and, with fsdp > 1, the largest weight and embedding slice
        gathered whole over fsdp for their dots; where the fast step scans its decoder
        (``step.scan.scanned_period``), one block's weights, which the scan copies.
      compute_dtype: the compute dtype of activations (default ``param_dtype``).
      backend: ``"cpu"`` adds the weight copies XLA:CPU makes for its dots, to compare with a CPU compile.
      loss_fn: ``step.segment_loss`` plans ``step.train_step``'s default step (segment attention in tiles, the
        loss in blocks of logits), as ``compiled_peak(loss_fn=)`` compiles it; ``step.tunix_loss``: Tunix's own
        attention and logits. With a batch
        the plan also carries Tunix's step (``tunix_step``), what it would need.
      qlora: a 4-bit base (QLoRA): every projection weight counts its 4-bit codes and float32 block scales
        as `gemport.checkpoint.quantize.load_qlora_model` places them. With ``backend="cpu"`` the plan adds the
        dequantized weights XLA:CPU holds through the step.

    Returns:
      A `MemoryPlan`: bytes per device of the base, the LoRA factors, Adam's moments and (with ``batch`` and
      ``seq_len``) the step; ``total_bytes``; ``fits`` against ``hbm_bytes``.

    Example:

      >>> from gemport import GemmaSpec, LoraSpec, memory_plan
      >>> plan = memory_plan(GemmaSpec.preset("gemma4-31b"), fsdp=1, tp=4, hbm_bytes="v5p",
      ...                    lora_spec=LoraSpec(rank=8, alpha=16), batch=2, seq_len=4096, remat="decoder")
      >>> round(plan.base_bytes / 2**30, 2), round(plan.total_bytes / 2**30, 2), plan.fits
      (14.29, 19.83, True)
    """
    check(spec, fsdp, tp)
    if remat == "projections" and not (lora_spec is not None and scanned_period(spec, lora_spec, remat)):
        raise MeshError("remat 'projections' keeps the adapted projections' products of a scanned decoder; this "
                        + ("plan has no LoRA" if lora_spec is None else "model's decoder cannot be scanned (per-layer "
                           "inputs, KV sharing or PEFT's alpha_pattern)") + "; plan remat 'decoder'")
    sizes = {FSDP: fsdp, TP: tp}
    params = annotated(spec)
    # Tunix creates every parameter in param_dtype, so elements per device times one itemsize is exact.
    base_elements = sum(bytes_per_device(shape, ann, sizes, 1) for _, shape, ann, _ in params)
    base_bytes = base_elements * np.dtype(param_dtype).itemsize
    if qlora is not None:
        base_bytes = sum(qlora_bytes_per_device(e, ann, sizes, qlora) if is_quantized(e)
                         else bytes_per_device(shape, ann, sizes, np.dtype(param_dtype).itemsize)
                         for _, shape, ann, e in params)
    trainable_dtype = np.dtype(param_dtype)
    factors = {}  # each LoRA factor's elements per device, by name
    if lora_spec is not None:
        trainable_dtype = np.dtype(lora_dtype or FACTOR_DTYPE)
        layout = LoraLayout(spec, lora_spec)
        lora_specs = layout.specs({path: ann for path, _, ann, _ in params})
        factors = {name: bytes_per_device(shape, lora_specs[name], sizes, 1) for name, shape in layout.shapes().items()}
    lora_elements = sum(factors.values())
    trainable = lora_elements if lora_spec is not None else base_elements
    moments_item = np.dtype(moments_dtype or trainable_dtype).itemsize
    planned = {}
    if batch is not None and seq_len is not None:
        for kind in dict.fromkeys((loss_fn, tunix_loss)):
            planned[kind] = (
                step_memory(spec, fsdp, tp, batch=batch, seq_len=seq_len, remat=remat,
                            trainable_bytes=trainable * trainable_dtype.itemsize, compute_dtype=compute_dtype or param_dtype,
                            loss_fn=kind, gathered_bytes=_gathered(spec, params, sizes, param_dtype, kind, qlora),
                            scanned_bytes=_scanned(spec, params, sizes, param_dtype, kind, qlora, remat, lora_spec,
                                                   factors, trainable_dtype),
                            projections=_projections(layout, factors) if lora_spec is not None else 0),
                _weight_copy(params, sizes, param_dtype, kind, qlora, compute_dtype) if backend == "cpu" else 0,
            )
    (step_plan, weight_copy), (tunix_plan, tunix_copy) = planned.get(loss_fn, (None, 0)), planned.get(tunix_loss, (None, 0))
    return MemoryPlan(
        fsdp,
        tp,
        base_bytes,
        lora_elements * trainable_dtype.itemsize,
        2 * trainable * moments_item,
        _hbm(hbm_bytes),
        step_plan,
        weight_copy,
        tunix_plan,
        tunix_copy,
    )


def _gathered(spec, params, sizes, param_dtype, loss_fn: LossFn, qlora=None) -> int:
    # fsdp shards weights along the model width; a dot needs the whole width, so the step all-gathers each weight
    # over fsdp just before its dot (forward, remat recompute, backward) into a temporary the size of its tp shard,
    # and frees it after: at the peak the largest layer weight is gathered (libtpu, 31B widths on a v6e-8). The
    # tied embedding is read by the loss: the fast step gathers one vocabulary slice of it at a time
    # (gemport.step.chunked_loss), Tunix's step all of it.
    if sizes[FSDP] == 1:
        return 0
    whole = {**sizes, FSDP: 1}
    item = np.dtype(param_dtype).itemsize

    def gathered(shape, ann, entry):
        if qlora is not None and is_quantized(entry):
            return qlora_bytes_per_device(entry, ann, whole, qlora)
        return bytes_per_device(shape, ann, whole, item)

    def sharded(ann):
        return any(FSDP in axes_of(a) for a in ann)

    weights = max((gathered(shape, ann, e) for path, shape, ann, e in params
                   if sharded(ann) and not path.endswith("input_embedding")), default=0)
    embedding = sum(bytes_per_device(shape, ann, whole, item) for path, shape, ann, _ in params
                    if path.endswith("input_embedding") and sharded(ann))
    if loss_fn is segment_loss:
        embedding //= num_slices(spec.vocab, VOCAB_SLICE)
    return weights + embedding


def _scanned(spec, params, sizes, param_dtype, loss_fn: LossFn, qlora, remat, lora_spec, factors,
             lora_dtype) -> int:
    # The fast step's scan (step.scan) chooses each layer's weights from its block's with a lax.switch, whose
    # result is a copy: one block's weights (and LoRA factors) per device are live besides the model's (libtpu,
    # Gemma 4 31B's widths on a v6e-8: the scanned step's peak exceeds the unrolled one's by that block, 0.68 GiB).
    period = scanned_period(spec, lora_spec, remat) if loss_fn is segment_loss else 0
    if not period:
        return 0
    block = tuple(f"layers.{i}." for i in range(period))
    item = np.dtype(param_dtype).itemsize
    base = sum(qlora_bytes_per_device(e, ann, sizes, qlora) if qlora is not None and is_quantized(e)
               else bytes_per_device(shape, ann, sizes, item)
               for path, shape, ann, e in params if path.startswith(block))
    return base + np.dtype(lora_dtype).itemsize * sum(n for name, n in factors.items() if name.startswith(block))


def _projections(layout: LoraLayout, factors: dict[str, int]) -> float:
    # An adapted projection's product (lora.qwix.PROJECTION: what remat "projections" keeps; the experts' products
    # are not named) has the widths of its lora_b without the rank axis: per device, lora_b's elements over its
    # rank, lora_a's last axis.
    return sum(factors[a.lora_b] / a.shapes[0][-1] for a in layout.adapters)


def _weight_copy(params, sizes, param_dtype, loss_fn: LossFn, qlora=None, compute_dtype=None) -> int:
    # XLA:CPU transposes q/kv/k einsum weights (D is not their leading axis) and, in Tunix's step, the
    # embedding (used as x @ E.T) into a temporary before each dot, one at a time: the largest one is live at
    # the peak. The fast step decodes slices of the embedding; XLA:CPU slices no bfloat16 array, so it holds
    # a 16-bit view of a bfloat16 one (gemport.step.chunked_loss).
    item = np.dtype(param_dtype).itemsize
    tiled = loss_fn is segment_loss
    copied = ("q_einsum.w", "kv_einsum.w", "k_einsum.w", "qkv_einsum.w") + (("input_embedding",) if not tiled
                                                                            else ())
    largest = max((bytes_per_device(shape, ann, sizes, item) for path, shape, ann, _ in params
                   if path.endswith(copied)), default=0)
    view = sum(bytes_per_device(shape, ann, sizes, item) for path, shape, ann, _ in params
               if tiled and np.dtype(param_dtype) == np.dtype("bfloat16") and path.endswith("input_embedding"))
    if qlora is None:
        return largest + view
    # On a 4-bit base XLA:CPU keeps every dequantized weight (in the compute dtype) from the forward pass to
    # the backward one, remat or not, instead of the transposed copy.
    compute = np.dtype(qlora.compute_dtype or compute_dtype or param_dtype).itemsize
    return view + sum(bytes_per_device(shape, ann, sizes, compute) for _, shape, ann, e in params if is_quantized(e))


def valid_meshes(spec: GemmaSpec, num_devices: int, **options) -> tuple[MemoryPlan, ...]:
    """A ``MemoryPlan`` for every (fsdp, tp) with fsdp * tp = ``num_devices`` that fits ``spec``, by tp.

    A mesh fits ``spec`` when each axis divides every dimension it shards (`gemport.mesh.valid_tp`, as
    `gemport.make_mesh` checks); whether its plan fits the chip's memory is the plan's ``fits``. Estimated
    without compiling, as `memory_plan` does.

    Args:
      spec: the architecture, e.g. ``GemmaSpec.preset("gemma4-31b")``.
      num_devices: the chips of the mesh, at least 1.
      **options: `memory_plan`'s keyword arguments (``lora_spec``, ``hbm_bytes``, dtypes, ``batch`` and
        ``seq_len``, ``remat``, ``backend``, ``qlora``, ``loss_fn``), which say what is counted.

    Returns:
      A tuple of `MemoryPlan`, one per valid tp in ascending order (fsdp = ``num_devices // tp``); empty when
      no tp divides ``spec``'s dimensions.

    Raises:
      MeshError: ``num_devices`` is not a positive integer, or an unknown chip name in ``hbm_bytes``.

    Example:

      >>> from gemport import GemmaSpec, LoraSpec, valid_meshes
      >>> plans = valid_meshes(GemmaSpec.preset("gemma4-31b"), 8, hbm_bytes="v5e",
      ...                      lora_spec=LoraSpec(rank=16, alpha=32), batch=8, seq_len=3584, remat="decoder")
      >>> [(plan.fsdp, plan.tp, plan.fits) for plan in plans]
      [(8, 1, False), (4, 2, True), (2, 4, True)]
    """
    return tuple(memory_plan(spec, num_devices // tp, tp, **options) for tp in valid_tp(spec, num_devices))
