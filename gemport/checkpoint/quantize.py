"""bitsandbytes' NF4 blocks as Qwix ``QArray`` s, and an HF checkpoint loaded onto a 4-bit base as it streams.

bitsandbytes quantizes an HF weight [out, in] in blocks of 64 consecutive elements of its row-major
flattening: ``absmax`` per block (float32), ``code`` per element the nearest NF4 value of ``w / absmax``.
`nf4` does the same in NumPy. `to_qarray` rearranges codes and absmax with the weight's names-table layout,
so a Tunix weight (e.g. ``attn_vec_einsum`` (N, H, D) from o_proj [D, N*H]) gets a Qwix ``QArray`` whose
scale tiles are exactly bitsandbytes' blocks: (1, 64, 1) when H is a multiple of 64, (64/H, H, 1) when H
divides 64. Qwix dequantizes ``code value * scale`` before each dot, which is what bitsandbytes' dequantize
computes. See `gemport.lora.QLoraSpec` for the config side and double quantization.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import qwix
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from gemport._src import upstream
from gemport._src.params import abstract_model, path_str
from gemport.checkpoint.hf_dir import HFCheckpoint, resolve_spec
from gemport.checkpoint.load import _place, _sharding, matched_entries
from gemport.checkpoint.safetensors import DTYPES
from gemport.errors import LoraError, MissingDependencyError
from gemport.lora.qlora import (
    NESTED_BLOCK_SIZE,
    QLoraSpec,
    is_quantized,
    scale_spec,
    tile_shape,
)
from gemport.specs import GemmaSpec, names


def nf4_values() -> np.ndarray:
    """The 16 NF4 values, from Qwix (the same float32 values as bitsandbytes' ``get_4bit_type("nf4")``)."""
    return np.asarray(upstream.nf4_buckets(), np.float32)


def nf4(weight: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """bitsandbytes' NF4 quantization of ``weight``: (codes uint8 of ``weight``'s shape, absmax float32).

    Blocks are ``block_size`` consecutive elements of the row-major flattening; ``absmax`` has one entry
    per block, in that order, so for [out, in] with ``in % block_size == 0`` it reshapes to
    [out, in / block_size]. A code is the index of the nearest NF4 value to ``w / absmax`` (ties to the lower).
    """
    flat = np.asarray(weight, np.float32).reshape(-1, block_size)
    absmax = np.abs(flat).max(axis=1)
    safe = np.where(absmax > 0, absmax, 1.0)[:, None]
    values = nf4_values()
    codes = np.searchsorted((values[1:] + values[:-1]) / 2, flat / safe).astype(np.uint8)
    return codes.reshape(np.shape(weight)), absmax


def require_double_quant() -> tuple[Any, Any]:
    """bitsandbytes' ``functional`` module and torch, which ``nested_absmax`` reproduces double quantization with.

    Raises:
      MissingDependencyError: either is missing; names the ``qlora`` extra.
    """
    try:
        import bitsandbytes.functional as bnb_f  # the qlora extra, with torch: optional
        import torch  # optional: torch
    except ImportError:
        raise MissingDependencyError(
            "double quantization (bnb_4bit_use_double_quant) reproduces bitsandbytes' 8-bit absmax with "
            "bitsandbytes itself: pip install 'gemport[qlora]'"
        ) from None
    return bnb_f, torch


def nested_absmax(absmax: np.ndarray) -> np.ndarray:
    """The absmax after bitsandbytes' double quantization: 8-bit blocks of 256 around the mean, dequantized.

    Uses bitsandbytes itself (``quantize_blockwise`` / ``dequantize_blockwise``) on the absmax vector, which
    is 1/64 of the weight; needs the ``qlora`` extra (``require_double_quant``).
    """
    bnb_f, torch = require_double_quant()
    scales = torch.from_numpy(np.ascontiguousarray(absmax, np.float32))
    offset = scales.mean()
    quantized, state = bnb_f.quantize_blockwise(scales - offset, blocksize=NESTED_BLOCK_SIZE)
    return (bnb_f.dequantize_blockwise(quantized, state) + offset).numpy()


def to_qarray(entry: names.Entry, arrays: list[np.ndarray], qlora: QLoraSpec) -> qwix.QArray:
    """The Qwix ``QArray`` of ``entry``'s Tunix weight from its HF tensors, quantized as bitsandbytes does.

    Each HF tensor is quantized on its own (one ``Linear4bit`` each); ``qvalue`` (uint4, NF4 codes) has the
    Tunix weight's shape, ``scale`` (float32) that shape divided by `tile_shape`. Memory: a few copies of
    one tensor.
    """
    tile = tile_shape(entry, qlora.block_size)
    codes, full_scales = [], []
    for array in arrays:
        code, absmax = nf4(array, qlora.block_size)
        if qlora.double_quant:
            absmax = nested_absmax(absmax)
        codes.append(code)
        full_scales.append(np.repeat(absmax.reshape(array.shape[0], -1), qlora.block_size, axis=-1))
    scale = entry.to_tunix(full_scales)[tuple(slice(None, None, t) for t in tile)]
    qvalue = entry.to_tunix(codes).astype(ml_dtypes.uint4)
    return qwix.QArray(np.ascontiguousarray(qvalue), np.ascontiguousarray(scale, np.float32), qtype=qlora.qtype)


def how_to_quantize(entry: names.Entry, qlora: QLoraSpec):
    """Qwix's description of the blocks `to_qarray` makes: tiled axes with tiles > 1, the others per channel."""
    tile = tile_shape(entry, qlora.block_size)
    return upstream.how_to_quantize(
        qtype=qlora.qtype,
        channelwise_axes=tuple(i for i, t in enumerate(tile) if t == 1),
        tiled_axes={i: t for i, t in enumerate(tile) if t > 1},
    )


def load_qlora_model(hf_dir: str | Path, qlora: QLoraSpec, *, spec: GemmaSpec | None = None, mesh=None,
                     compute_dtype=None):
    """Load an HF Gemma checkpoint as a Tunix model on a 4-bit base, quantizing each tensor as it is placed.

    Every projection weight (`gemport.lora.qlora.QUANTIZED`) becomes a Qwix ``WithAux(QArray)`` (uint4 codes, float32
    bitsandbytes scales, see `to_qarray`) in its Tunix sharding (a scale axis that the mesh axis does not
    divide is replicated); every other parameter loads as in `gemport.checkpoint.load_model`. Host memory is
    one tensor and its quantized copies at a time. Give the result to `gemport.lora.apply_lora` with the
    same ``qlora`` to train LoRA on it.

    Args:
      hf_dir: an unquantized (bf16 / fp32) HF checkpoint, as bitsandbytes is given it.
      qlora: the 4-bit base (`QLoraSpec.from_config`).
      spec, mesh: as in `gemport.checkpoint.load_hf`.
      compute_dtype: the unquantized parameters' and the computation's dtype; default ``qlora.compute_dtype``, else
        the checkpoint's.

    Returns:
      The Tunix model (as from `gemport.checkpoint.load_model`) whose projection weights are 4-bit: each a
      ``WithAux(QArray)`` of uint4 codes in the weight's shape and float32 scales, one per bitsandbytes block
      (the weight's shape divided by `tile_shape`); the other parameters in ``compute_dtype``.

    Raises:
      LoraError: a Gemma 4 model with per-layer inputs or MoE (bitsandbytes also quantizes their extra
        linears, which gemport does not), or widths that bitsandbytes' blocks do not tile (`tile_shape`).
    """
    ckpt = HFCheckpoint(hf_dir)
    spec = resolve_spec(hf_dir, spec, "hf_dir")
    if spec.per_layer_input_dim or spec.num_experts:
        raise LoraError(
            f"{hf_dir}: QLoRA on a Gemma 4 model with per-layer inputs or experts: bitsandbytes also quantizes "
            "their projections and router, which gemport's 4-bit base does not cover; use a dense model"
        )
    prefix, entries = matched_entries(ckpt, spec)
    target = np.dtype(compute_dtype or qlora.compute_dtype or DTYPES[ckpt.info(prefix + "embed_tokens.weight").dtype])
    graphdef, abstract = nnx.split(abstract_model(spec, param_dtype=target))
    by_path = {e.tunix: e for e in entries}
    flat, quantized = [], []
    for path, var in tqdm(nnx.to_flat_state(abstract), desc="load_qlora", unit="tensor", leave=False):
        entry = by_path[path_str(path)]
        sharding = _sharding(var, mesh)
        if not is_quantized(entry):
            flat.append((path, var.replace(_place(ckpt, prefix, entry, var.get_value().shape, target, sharding))))
            continue
        q = to_qarray(entry, [ckpt.array(prefix + h) for h in entry.hf], qlora)
        qvalue = jax.device_put(q.qvalue, sharding)
        scale = jax.device_put(q.scale, _scale_sharding(sharding, q.scale.shape))
        flat.append((path, var.replace(qvalue)))
        quantized.append((path, qwix.QArray(qvalue, scale, qtype=q.qtype), how_to_quantize(entry, qlora)))
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    for path, q, how in quantized:
        set_quantized(model, path, q, how)
    return model


def set_quantized(model, path, q, how) -> None:
    """Replace the Param at ``path`` of ``model`` (in place) by the 4-bit weight ``q`` (a Qwix ``QArray``) as
    Qwix's PTQ stores one: ``WithAux(q, how)`` with its leaves boxed like the original Param."""
    module = model
    for key in path[:-1]:
        module = module[key] if isinstance(key, int) else getattr(module, key)
    param = getattr(module, path[-1])
    setattr(module, path[-1], jax.tree.map(param.replace, upstream.with_aux(q, how)))


def _scale_sharding(sharding, shape):
    if not isinstance(sharding, NamedSharding):
        return sharding
    return NamedSharding(sharding.mesh, PartitionSpec(*scale_spec(sharding.spec, shape, dict(sharding.mesh.shape))))


