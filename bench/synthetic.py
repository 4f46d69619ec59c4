"""A synthetic bf16 HF checkpoint with Gemma 4 31B's real dimensions and a few layers.

Hidden 5376, MLP 21504, 32 query heads, 16 x 256 KV heads on sliding layers, 4 x 512 K-only heads on global
layers, vocab 262144: with 2 layers it is 4.8 GB, like the slice the published port measured. Tensors are
filled by repeating one random block, so writing costs disk bandwidth, not RNG time, and never holds a
whole tensor in memory.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import ml_dtypes
import numpy as np

from gemport.specs import names
from gemport.checkpoint.output import write_sharded
from gemport.checkpoint.safetensors import TensorSource
from gemport.specs import GemmaSpec

_BLOCK = np.random.default_rng(0).standard_normal(2**22).astype(ml_dtypes.bfloat16) * np.asarray(
    0.02, ml_dtypes.bfloat16
)


def spec_31b(num_layers: int) -> GemmaSpec:
    """gemma4-31b with ``num_layers`` layers in its 5:1 pattern, the last one global."""
    full = GemmaSpec.preset("gemma4-31b")
    types = full.layer_types[:num_layers - 1] + ("global",)
    return dataclasses.replace(full, num_layers=num_layers, layer_types=types)


def _repeated(nbytes: int):
    def write(fh):
        block = memoryview(_BLOCK.view(np.uint8))
        left = nbytes
        while left:
            n = min(left, len(block))
            fh.write(block[:n])
            left -= n

    return write


def write_checkpoint(out_dir: str | Path, num_layers: int, *, prefix: str = "model.",
                     max_shard_size: str = "2GB") -> int:
    """Write the synthetic checkpoint to ``out_dir`` (created); returns its tensor bytes.

    ``prefix`` is the text prefix of the keys: ``model.`` as ``Gemma4ForCausalLM`` saves, or
    ``model.language_model.`` as ``Gemma4ForConditionalGeneration`` does (the only one Tunix's own loader reads).
    """
    spec = spec_31b(num_layers)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sources = []
    for entry in names.entries(spec):
        for h in entry.hf:
            shape = entry.hf_shape
            nbytes = int(np.prod(shape)) * 2
            sources.append(TensorSource(prefix + h, "BF16", shape, _repeated(nbytes)))
    write_sharded(out, sources, max_shard_size, desc="synthetic")
    config = spec.to_hf_config()
    if prefix == "model.language_model.":
        config = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
                  "text_config": config, "dtype": "bfloat16"}
    (out / "config.json").write_text(json.dumps(dict(config, dtype="bfloat16"), indent=2))
    return sum(s.nbytes for s in sources)
