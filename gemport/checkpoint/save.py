"""Tunix parameters -> HF safetensors, tensor by tensor, atomically."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from gemport.specs import names
from gemport.checkpoint.hf_dir import HFCheckpoint, resolve_spec
from gemport.checkpoint.load import matched_entries
from gemport.checkpoint.output import atomic_dir, check_output, copy_side_files, write_sharded
from gemport.checkpoint.safetensors import TensorSource
from gemport._src.params import flat_params
from gemport.specs import GemmaSpec
from gemport._src.tensors import check_tensors


def save_hf(state_or_model, out_dir: str | Path, *, base_dir: str | Path | None = None,
            spec: GemmaSpec | None = None, max_shard_size: int | str = "5GB") -> Path:
    """Write Tunix parameters as an HF checkpoint: sharded safetensors, index and config.json.

    Each Tunix parameter is gathered, converted back to its HF tensor(s) (``gemport.specs.names``) in its own
    dtype, and written before the next is read, so peak memory is one tensor beyond the state itself.
    The directory appears atomically when complete.

    Args:
      state_or_model: a Tunix Gemma model, or its ``nnx.State`` of parameters (as from ``load_hf``).
      out_dir: the output directory; must not exist, be empty, or lie inside ``base_dir``.
      base_dir: the HF checkpoint the state came from (its text tensors must have the state's shapes). Gives
        the architecture; its key prefix is kept (e.g. ``model.language_model.`` of multimodal checkpoints),
        its non-text tensors (vision, audio) are copied byte for byte, and its config, tokenizer and other
        files are copied.
      spec: the architecture, without ``base_dir`` (then keys use ``model.`` and config.json is generated
        for ``Gemma3ForCausalLM`` / ``Gemma4ForCausalLM``); with it, checked against its config (else
        ``SpecError``).
      max_shard_size: bytes per shard, an int or a string such as ``"5GB"``.

    Returns:
      The output directory.
    """
    spec = resolve_spec(base_dir, spec)
    params = flat_params(state_or_model)
    entries = names.entries(spec)
    lora = any("lora" in p for p in params)
    check_tensors(
        {p: tuple(v.shape) for p, v in params.items()},
        {e.tunix: e.tunix_shape for e in entries},
        source="state",
        fix=(f"the state is not of a {spec.family} model with this spec"
             + ("; LoRA params must be merged with export_merged" if lora else "")),
    )
    out = check_output(out_dir, base_dir)
    base = HFCheckpoint(base_dir) if base_dir is not None else None
    prefix = "model."
    if base:
        prefix, _ = matched_entries(base, spec)

    sources = []
    for e in entries:
        if not e.hf:
            continue
        array = params[e.tunix]
        for i, h in enumerate(e.hf):
            sources.append(TensorSource.from_array(prefix + h, _hf_tensor(e, array, i), array.dtype, e.hf_shape))
    if base:
        sources += [TensorSource.copy_of(k, base.info(k)) for k in base.keys() if not names.owns(k, prefix)]

    with atomic_dir(out) as tmp:
        write_sharded(tmp, sources, max_shard_size, desc="save_hf")
        if base:
            copy_side_files(base.dir, tmp)
        else:
            config = dict(spec.to_hf_config(), dtype=str(np.dtype(next(iter(params.values())).dtype)))
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def _hf_tensor(entry: names.Entry, array: jax.Array, i: int):
    def make() -> np.ndarray:
        return entry.to_hf(np.asarray(jax.device_get(array)))[i]

    return make
