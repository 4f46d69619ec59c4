"""Memory plans: what each device holds (params, LoRA params, Adam moments) on an (fsdp, tp) mesh."""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from gemport.errors import MeshError
from gemport.mesh.dims import FSDP, TP, annotated
from gemport.mesh.factory import check, valid_tp
from gemport.sharding import lora_shapes, lora_specs
from gemport.sharding._specs import bytes_per_device
from gemport.specs import GemmaSpec

GiB = 2**30

# HBM per chip (one JAX device), from Google Cloud's TPU system architecture pages.
HBM = {"v4": 32 * GiB, "v5e": 16 * GiB, "v5p": 95 * GiB, "v6e": 32 * GiB}

# Qwix module_path regex (matched against "/"-joined module paths): every attention and MLP projection.
LORA_TARGETS = r".*/(q_einsum|kv_einsum|k_einsum|qkv_einsum|attn_vec_einsum|gate_proj|up_proj|down_proj)"


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
    """

    fsdp: int
    tp: int
    base_bytes: int
    lora_bytes: int
    optimizer_bytes: int
    hbm_bytes: int | None = None

    @property
    def total_bytes(self) -> int:
        return self.base_bytes + self.lora_bytes + self.optimizer_bytes

    @property
    def fits(self) -> bool | None:
        """Whether ``total_bytes`` fits ``hbm_bytes`` (None without it). Activations and gradients need room too."""
        return None if self.hbm_bytes is None else self.total_bytes <= self.hbm_bytes

    def __str__(self):
        text = (
            f"fsdp={self.fsdp} tp={self.tp}: base {_human(self.base_bytes)} + LoRA {_human(self.lora_bytes)} + "
            f"Adam mu,nu {_human(self.optimizer_bytes)} = {_human(self.total_bytes)} per device"
        )
        if self.hbm_bytes is None:
            return text
        return text + f" of {_human(self.hbm_bytes)}: " + ("fits" if self.fits else "does not fit")


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
    lora_rank: int | None = None,
    hbm_bytes: int | str | None = None,
    param_dtype="bfloat16",
    lora_dtype=None,
    moments_dtype=None,
    targets: str = LORA_TARGETS,
) -> MemoryPlan:
    """Per-device bytes of params, LoRA params and Adam moments on an (fsdp, tp) mesh.

    Every array counts ``prod(shape) / prod(sizes of the axes its spec shards)`` elements: base params
    with their Tunix annotations, LoRA factors with the specs ``gemport.sharding.lora_specs`` derives
    (Qwix creates them in the base weight's dtype) for each module whose "/"-joined path fully matches
    ``targets`` (K/V of KV-shared layers excluded: they never run, so Qwix adds nothing there). Adam keeps
    mu and nu, each shaped and sharded like the trainable params, in ``moments_dtype`` (default: the
    trainable params' dtype, as ``optax.adamw`` does).

    Args:
      lora_rank: LoRA rank r; None plans full fine-tuning (moments for every param, no LoRA).
      hbm_bytes: HBM per device in bytes, or a chip name from ``HBM`` (e.g. ``"v5p"``).
    """
    check(spec, fsdp, tp)
    sizes = {FSDP: fsdp, TP: tp}
    params, modules = annotated(spec)
    # Tunix creates every parameter in param_dtype, so elements per device times one itemsize is exact.
    base_elements = sum(bytes_per_device(shape, ann, sizes, 1) for _, shape, ann, _ in params)
    trainable_dtype = np.dtype(param_dtype)
    lora_elements = 0
    if lora_rank is not None:
        trainable_dtype = np.dtype(lora_dtype or param_dtype)
        unused = {e.tunix for *_, e in params if e.fill is not None}
        for match_path, weight, shape, ann, equation in modules:
            if weight in unused or not re.fullmatch(targets, match_path):
                continue
            parts = zip(lora_shapes(shape, equation, lora_rank), lora_specs(ann, len(shape), equation))
            lora_elements += sum(bytes_per_device(s, p, sizes, 1) for s, p in parts)
    trainable = lora_elements if lora_rank is not None else base_elements
    moments_item = np.dtype(moments_dtype or trainable_dtype).itemsize
    return MemoryPlan(
        fsdp,
        tp,
        base_elements * np.dtype(param_dtype).itemsize,
        lora_elements * trainable_dtype.itemsize,
        2 * trainable * moments_item,
        _hbm(hbm_bytes),
    )


def valid_meshes(
    spec: GemmaSpec,
    num_devices: int,
    *,
    hbm_bytes: int | str | None = None,
    lora_rank: int | None = None,
    param_dtype="bfloat16",
    lora_dtype=None,
    moments_dtype=None,
    targets: str = LORA_TARGETS,
) -> tuple[MemoryPlan, ...]:
    """A ``MemoryPlan`` for every (fsdp, tp) with fsdp * tp = ``num_devices`` that fits ``spec``, by tp.

    E.g. ``valid_meshes(GemmaSpec.preset("gemma4-31b"), 4, hbm_bytes="v5p", lora_rank=16)`` lists tp = 1, 2, 4
    with what each v5p chip holds. See ``memory_plan`` for what is counted.
    """
    return tuple(
        memory_plan(
            spec, num_devices // tp, tp, lora_rank=lora_rank, hbm_bytes=hbm_bytes, param_dtype=param_dtype,
            lora_dtype=lora_dtype, moments_dtype=moments_dtype, targets=targets,
        )
        for tp in valid_tp(spec, num_devices)
    )  # fmt: skip
