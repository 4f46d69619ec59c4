"""Qwix LoRA + an HF base checkpoint -> merged HF safetensors (for vLLM), streamed tensor by tensor."""

from __future__ import annotations

import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from gemport.checkpoint.adapters import load_lora
from gemport.checkpoint.hf_dir import HFCheckpoint
from gemport.checkpoint.load import matched_entries
from gemport.checkpoint.output import atomic_dir, check_output, copy_side_files, write_sharded
from gemport.checkpoint.safetensors import DTYPES, TensorInfo, TensorSource, read_array
from gemport.errors import CorruptFileError
from gemport.lora import LoraLayout, LoraSpec
from gemport._src.params import flat_params
from gemport.specs import GemmaSpec

# Float32 bytes of the rows merged at a time. Bounds memory whatever the tensor's size, and stays below glibc's
# mmap threshold so that blocks reuse heap pages instead of faulting fresh ones in.
_BLOCK_BYTES = 16 * 2**20


def export_merged(lora, out_dir: str | Path, *, base_dir: str | Path, lora_spec: LoraSpec | None = None,
                  step: int | None = None, max_shard_size: int | str = "5GB") -> Path:
    """Write the base checkpoint with the LoRA deltas merged in, as an HF checkpoint directory.

    Each adapted HF weight W [out, in] becomes ``W + lora_B @ lora_A * scale`` (the module's PEFT scale), computed in float32 a block
    of rows at a time and cast to W's dtype; fused Tunix modules are split per ``gemport.specs.names``. Every other
    tensor (embeddings, norms, vision and audio towers) is copied byte for byte without being decoded.
    Config, tokenizer and other files are copied. Peak memory is the adapter plus a few 16 MiB blocks,
    independent of model size. The directory appears atomically when complete.

    Args:
      lora: the LoRA factors, anything `load_lora` reads: `LoraParams`, an nnx model or state, a flat dict, or
        a PeftTrainer Orbax checkpoint path (root, step or ``model_params`` directory).
      out_dir: the output directory; must not exist or be empty, nor lie inside an input.
      base_dir: the HF checkpoint the adapter was trained on (single file or sharded, any text prefix); gives
        the architecture.
      lora_spec: rank, alpha and targets of the adapter; default the one ``lora`` carries or `save_lora_spec`
        recorded beside an Orbax checkpoint.
      step: with an Orbax checkpoint root, the step to export; default the latest.
      max_shard_size: bytes per output shard, an int or a string such as ``"5GB"``.

    Returns:
      The output directory.
    """
    base = Path(base_dir)
    out = check_output(out_dir, base, lora if isinstance(lora, (str, os.PathLike)) else None)
    params, lora_spec = load_lora(lora, lora_spec=lora_spec, step=step)
    params = flat_params(params)
    spec = GemmaSpec.from_hf(base)
    ckpt = HFCheckpoint(base)
    prefix, _ = matched_entries(ckpt, spec)
    deltas = {}
    layout = LoraLayout(spec, lora_spec)
    for adapter, a, b in layout.match(params):
        for module, scale, (A, B) in zip(adapter.hf_modules, adapter.peft_scales, adapter.to_peft(a, b)):
            deltas[f"{prefix}{module}.weight"] = (A.astype(np.float32), B.astype(np.float32) * np.float32(scale))
    experts = {f"{prefix}{adapter.parameter}": (adapter, a, b) for adapter, a, b in layout.match_experts(params)}
    ordered = sorted(ckpt.tensors.items(), key=lambda kv: (str(kv[1].file), kv[1].start))
    sources = [
        _merged(name, info, *deltas[name]) if name in deltas
        else _merged_experts(name, info, *experts[name]) if name in experts
        else TensorSource.copy_of(name, info)
        for name, info in ordered
    ]
    with atomic_dir(out) as tmp:
        write_sharded(tmp, sources, max_shard_size, desc="export_merged")
        copy_side_files(base, tmp)
    return out


@jax.jit
def _add_delta(w: jax.Array, b: jax.Array, a: jax.Array) -> tuple[jax.Array, jax.Array]:
    # XLA rather than numpy: OpenBLAS's threads thrash on a busy host, and this fuses the casts, the add and the
    # NaN/Inf check.
    merged = (w.astype(jnp.float32) + jnp.matmul(b, a, precision=jax.lax.Precision.HIGHEST)).astype(w.dtype)
    return merged, jnp.isfinite(merged).all()


def _merged_experts(name: str, info: TensorInfo, adapter, a: np.ndarray, b: np.ndarray) -> TensorSource:
    """A stacked expert parameter [E, out, in] plus ``adapter``'s delta (`gemport.lora.experts.ExpertAdapter`),
    in float32, cast to its dtype: one layer's expert stack at a time."""

    def make() -> np.ndarray:
        return (read_array(info).astype(np.float32) + adapter.delta(a, b)).astype(DTYPES[info.dtype])

    return TensorSource.from_array(name, make, DTYPES[info.dtype], info.shape)


def _merged(name: str, info: TensorInfo, A: np.ndarray, B: np.ndarray) -> TensorSource:
    """``W + B @ A`` written a block of rows at a time; ``B`` already carries the LoRA scale.

    Computed on the host CPU whatever the default JAX device, in float32. One worker thread merges the next
    block while this one is written, so compute hides behind the disk.
    """
    dtype = DTYPES[info.dtype]
    rows, cols = info.shape
    step = max(1, _BLOCK_BYTES // (4 * cols))
    cpu = jax.devices("cpu")[0]

    def merge(raw: memoryview, start: int) -> np.ndarray:
        w = np.frombuffer(raw, dtype).reshape(-1, cols)
        b = B[start : start + w.shape[0]]
        n = w.shape[0]
        if n < step:
            # The last block is padded to a full one, so each weight width compiles once, not once per tail.
            w, b = np.pad(w, ((0, step - n), (0, 0))), np.pad(b, ((0, step - n), (0, 0)))
        merged, finite = _add_delta(*(jax.device_put(x, cpu) for x in (w, b, A)))
        if not finite:
            warnings.warn(f"{info.file}: tensor {name!r} holds NaN or Inf once merged; the merged model computes "
                          "NaN", RuntimeWarning, stacklevel=2)
        return np.asarray(merged)[:n]

    def write(fh) -> None:
        # Two read buffers: block k is read into one while block k - 1, in the other, is being merged.
        buffers = [bytearray(step * cols * dtype.itemsize) for _ in range(2)]
        with open(info.file, "rb") as src, ThreadPoolExecutor(1) as pool:
            src.seek(info.start)
            pending = None
            for k, start in enumerate(range(0, rows, step)):
                raw = memoryview(buffers[k % 2])[: min(step, rows - start) * cols * dtype.itemsize]
                if src.readinto(raw) != len(raw):
                    raise CorruptFileError(f"{info.file}: ended while reading tensor {name!r}")
                merged = pool.submit(merge, raw, start)
                if pending is not None:
                    fh.write(memoryview(pending.result().reshape(-1).view(np.uint8)))
                pending = merged
            fh.write(memoryview(pending.result().reshape(-1).view(np.uint8)))

    return TensorSource(name, info.dtype, info.shape, write)
