"""`QLoraSpec`: a QLoRA recipe's 4-bit base (bitsandbytes) as the Qwix quantization gemport reproduces.

A GPU QLoRA recipe loads its base with ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
bnb_4bit_use_double_quant=..., bnb_4bit_compute_dtype=...)`` (TRL: ``load_in_4bit``, ``bnb_4bit_quant_type``,
``use_bnb_nested_quant``, ``dtype``) and trains plain LoRA factors on it. bitsandbytes quantizes every
``nn.Linear`` weight [out, in], flattened row-major, in blocks of 64 consecutive elements: one float32 absmax
per block and, per element, the nearest of the 16 NF4 values times that absmax. Qwix has the same 16 values
(qtype ``"nf4"``, emulated: dequantized before each dot), so gemport builds Qwix's ``QArray`` from those
blocks directly (`gemport.checkpoint.quantize`): the codes are bitsandbytes' codes and the scales its absmax,
laid out in Tunix's axes. Qwix's own quantizer would instead tile only the last contracting axis (on
``attn_vec_einsum`` one scale per 64 head dims shared across all heads), a different base.

Double quantization (bitsandbytes' ``compress_statistics``) stores the absmax itself in 8 bits (blocks of 256,
around their mean). gemport reproduces its values (the scales are bitsandbytes' dequantized 8-bit absmax),
but keeps them as float32, so it does not have the 0.37 bit/parameter that nesting saves.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from os import PathLike
from pathlib import Path
from typing import Any

from gemport.specs import names
from gemport._src.jsonfile import Fields, read_json
from gemport._src.partition import axes_of, padded
from gemport._src.partition import bytes_per_device as per_device
from gemport.errors import LoraError
from gemport.lora.config import PROJECTIONS

# bitsandbytes' block for 4-bit weights; transformers' BitsAndBytesConfig does not expose it.
BLOCK_SIZE = 64
# bitsandbytes' block for the 8-bit absmax of double quantization.
NESTED_BLOCK_SIZE = 256
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
# Tunix weights made of the HF linear projections bitsandbytes replaces with Linear4bit.
QUANTIZED = ("q_einsum.w", "qkv_einsum.w", "kv_einsum.w", "k_einsum.w", "attn_vec_einsum.w",
             "gate_proj.kernel", "up_proj.kernel", "down_proj.kernel")


@dataclasses.dataclass(frozen=True)
class QLoraSpec:
    """The 4-bit base of a QLoRA recipe, as Qwix holds it.

    Attributes:
      qtype: Qwix's qtype, ``"nf4"`` (bitsandbytes' NF4 values, Appendix E of the QLoRA paper).
      block_size: elements per absmax block along an HF weight's input dimension (bitsandbytes: 64).
      double_quant: the scales are bitsandbytes' 8-bit nested absmax, dequantized (see the module doc).
      compute_dtype: ``bnb_4bit_compute_dtype`` (``"bfloat16"``...), or None for the weights' dtype: the dtype
        the dequantized weights and activations are computed in.
    """

    qtype: str = "nf4"
    block_size: int = BLOCK_SIZE
    double_quant: bool = False
    compute_dtype: str | None = None

    def __post_init__(self):
        if self.qtype != "nf4":
            raise LoraError(f"qtype={self.qtype!r}: gemport reproduces bitsandbytes' 'nf4' only")
        if self.block_size != BLOCK_SIZE:
            raise LoraError(f"block_size={self.block_size}: bitsandbytes' 4-bit blocks are {BLOCK_SIZE} elements")
        if self.compute_dtype not in (None, *COMPUTE_DTYPES):
            raise LoraError(f"compute_dtype={self.compute_dtype!r}: expected one of {COMPUTE_DTYPES} or None")

    def __str__(self) -> str:
        """What the commands print of the base: ``"nf4 4-bit base (double quantization)"``."""
        return f"{self.qtype} 4-bit base{' (double quantization)' if self.double_quant else ''}"

    @property
    def bits_per_weight(self) -> float:
        """What Qwix holds per quantized weight, in bits: a 4-bit code plus a float32 scale per block (4.5)."""
        return 4 + 32 / self.block_size

    @classmethod
    def from_config(cls, config: Any) -> QLoraSpec | None:
        """The 4-bit base a recipe asks for, or None when it loads its base unquantized.

        ``config``: a ``transformers.BitsAndBytesConfig`` or its dict (``quantization_config`` of a
        ``config.json``), a model's config dict / ``config.json`` / checkpoint directory holding one, TRL's
        ``ModelConfig`` or a dict of its fields (``load_in_4bit``, ``bnb_4bit_quant_type``,
        ``use_bnb_nested_quant``, ``dtype`` / ``torch_dtype``, which TRL passes as the compute dtype). A
        ``trl sft --config`` YAML is read by ``gemport.recipe.read(path).qlora()``.

        Raises ``LoraError`` naming the field for what gemport cannot reproduce: 8-bit (LLM.int8()),
        bitsandbytes' FP4 (its 16 values are none of Qwix's 4-bit floats), another ``quant_method`` (GPTQ,
        AWQ...), projections left unquantized (``llm_int8_skip_modules``), CPU offload.
        """
        cfg, source = _fields(config)
        if "quantization_config" in cfg:
            cfg, source = dict(cfg["quantization_config"] or {}), f"{source} quantization_config"
        fields = Fields(cfg, source, LoraError)
        method = fields.string("quant_method", "bitsandbytes")
        method = str(getattr(method, "value", method))
        if method != "bitsandbytes":
            raise LoraError(f"{source}: quant_method={method!r}: gemport reproduces bitsandbytes' 4-bit bases only")
        if fields.boolean("load_in_8bit", False):
            raise LoraError(
                f"{source}: load_in_8bit=True: LLM.int8() keeps outlier columns in 16 bits beside 8-bit rows; "
                "Qwix's int8 is a different quantizer. Use load_in_4bit with nf4, or the unquantized base"
            )
        if not fields.boolean("load_in_4bit", False):
            return None
        quant_type = fields.string("bnb_4bit_quant_type", "nf4")
        if quant_type != "nf4":
            raise LoraError(
                f"{source}: bnb_4bit_quant_type={quant_type!r}: bitsandbytes' FP4 has its own 16 values, none of "
                "Qwix's 4-bit floats (float4_e2m1fn, mxfp4, nvfp4) has them; use 'nf4'"
            )
        skipped = fields.strings("llm_int8_skip_modules", []) + fields.strings("modules_to_not_convert", [])
        kept = sorted({p for p in PROJECTIONS for m in skipped if m == p or m.endswith("." + p)})
        if kept:
            raise LoraError(
                f"{source}: llm_int8_skip_modules keeps {kept} unquantized; gemport quantizes every projection of "
                "the text layers (lm_head and vision modules may be listed)"
            )
        if fields.boolean("llm_int8_enable_fp32_cpu_offload", False):
            raise LoraError(f"{source}: llm_int8_enable_fp32_cpu_offload=True: offloaded modules stay unquantized; "
                            "drop it")
        double_quant = cfg.get("bnb_4bit_use_double_quant", cfg.get("use_bnb_nested_quant")) or False
        if not isinstance(double_quant, bool):
            fields.fail("bnb_4bit_use_double_quant", double_quant, "true or false")
        compute = next((cfg[k] for k in ("bnb_4bit_compute_dtype", "dtype", "torch_dtype") if cfg.get(k)), None)
        return cls(double_quant=double_quant, compute_dtype=_dtype_name(compute, source))

    def to_bnb(self) -> dict[str, Any]:
        """The ``BitsAndBytesConfig(**d)`` fields of this base."""
        return {
            "load_in_4bit": True,
            "bnb_4bit_quant_type": self.qtype,
            "bnb_4bit_use_double_quant": self.double_quant,
            "bnb_4bit_compute_dtype": self.compute_dtype or "float32",
        }


def is_quantized(entry) -> bool:
    """Whether bitsandbytes quantizes a names-table entry's weight: a linear projection read from the checkpoint."""
    return entry.fill is None and entry.tunix.endswith(QUANTIZED)


def _fields(config: Any) -> tuple[dict[str, Any], str]:
    if isinstance(config, (str, PathLike)):
        path = Path(config)
        if path.suffix in (".yaml", ".yml"):  # a recipe is read once, at gemport.recipe's boundary
            raise LoraError(f"{path}: a trl sft recipe; read it with gemport.recipe.read({str(path)!r}).qlora(), "
                            "which checks every field as gemport sft does")
        cfg = read_json(path, "config.json", LoraError, "a checkpoint directory, its config.json, a TRL YAML or a dict")
        return cfg, str(path / "config.json" if path.is_dir() else path)
    if isinstance(config, Mapping):
        return dict(config), "QLoRA config"
    if hasattr(config, "to_dict"):
        return dict(config.to_dict()), type(config).__name__
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}, type(config).__name__
    raise LoraError(f"{config!r:.80}: pass a BitsAndBytesConfig, TRL ModelConfig, a dict, or a config.json path")


def _dtype_name(value: Any, source: str) -> str | None:
    if value is None or value == "auto":
        return None
    name = str(value).removeprefix("torch.")
    if name not in COMPUTE_DTYPES:
        raise LoraError(f"{source}: compute dtype {value!r}: expected one of {COMPUTE_DTYPES}")
    return name


def tile_shape(entry: names.Entry, block_size: int) -> tuple[int, ...]:
    """The Tunix-axis shape of one bitsandbytes block of ``entry``'s weight, e.g. (1, 64, 1) for
    ``attn_vec_einsum`` ``d (n h) -> n h d`` with h = 256.

    A block runs along the HF input dimension (the last HF group), over its trailing axes. Raises
    ``LoraError`` when blocks would straddle rows or heads unevenly (an input width or head width neither a
    multiple nor a divisor of the block), which Qwix's per-axis tiles cannot express.
    """
    pattern, sizes = entry.pattern, dict(entry.sizes)
    tile, remaining = {}, block_size
    for axis in reversed(pattern.left[-1]):
        size = sizes[axis]
        take = min(size, remaining)
        if size % take or remaining % take:
            break
        tile[axis], remaining = take, remaining // take
    if remaining != 1:
        widths = ", ".join(f"{a}={sizes[a]}" for a in pattern.left[-1])
        raise LoraError(
            f"{entry.hf[0]}: input dimension ({widths}) does not split into bitsandbytes' {block_size}-element "
            "blocks along its axes; Qwix scale tiles cannot hold them. Use a model whose widths are multiples of 64"
        )
    return tuple(math.prod(tile.get(a, 1) for a in dim) for dim in pattern.right)


def scale_spec(spec, shape, axis_sizes) -> tuple:
    """The partition spec of a scale of ``shape`` from its weight's ``spec``: an axis the mesh does not divide
    (a tile spanning the whole axis, or D/64 blocks over fsdp) is replicated, since JAX places no uneven shards."""
    return tuple(e if size % math.prod(axis_sizes[a] for a in axes_of(e)) == 0 else None
                 for e, size in zip(padded(tuple(spec), len(shape)), shape))


def bytes_per_device(entry: names.Entry, spec, axis_sizes, qlora: QLoraSpec) -> int:
    """Bytes one device holds of ``entry``'s 4-bit weight placed with ``spec``: 4-bit codes (TPUs pack two per
    byte) and the float32 scales in `scale_spec`."""
    shape = entry.tunix_shape
    scale = tuple(n // t for n, t in zip(shape, tile_shape(entry, qlora.block_size)))
    return per_device(shape, spec, axis_sizes, 1) // 2 + per_device(scale, scale_spec(spec, scale, axis_sizes),
                                                                    axis_sizes, 4)
