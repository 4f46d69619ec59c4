"""HF safetensors -> Tunix parameters, streamed tensor by tensor straight into their mesh shardings."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from gemport.specs import names
from gemport.checkpoint.hf_dir import HFCheckpoint, resolve_spec
from gemport.checkpoint.safetensors import DTYPES, FLOAT_DTYPES
from gemport.errors import CheckpointError
from gemport._src.params import abstract_model, path_str
from gemport._src.partition import named_sharding
from gemport.specs import GemmaSpec
from gemport._src.tensors import check_tensors


def matched_entries(ckpt: HFCheckpoint, spec: GemmaSpec) -> tuple[str, tuple[names.Entry, ...]]:
    """Check that ``ckpt``'s text tensors are exactly those ``spec`` needs, with the right shapes.

    Returns the checkpoint's text prefix and the spec's entries. Raises ``MissingTensorError``,
    ``UnexpectedTensorError`` or ``ShapeMismatchError`` naming the tensor, its file and what was expected.
    """
    keys = ckpt.keys()
    prefix = names.detect_prefix(keys)
    entries = names.entries(spec)
    wanted = {prefix + h: e for e in entries for h in e.hf}
    check_tensors(
        {k: ckpt.tensors[k].shape for k in keys if names.owns(k, prefix) and k != "lm_head.weight"},
        {k: e.hf_shape for k, e in wanted.items()},
        source=str(ckpt.dir),
        fix="config.json does not describe these weights; use the config the checkpoint was saved with",
        file_of=lambda k: ckpt.info(k).file,
        about=lambda k: f"Tunix {wanted[k].tunix}; {', '.join(f'{a}={n}' for a, n in wanted[k].sizes if a != 's')}",
    )
    for full in wanted:
        if ckpt.tensors[full].dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                f"{ckpt.tensors[full].file}: tensor {full!r} is {ckpt.tensors[full].dtype}, but a Gemma weight is a "
                f"float ({', '.join(FLOAT_DTYPES)}); this is a quantized or damaged checkpoint, use the float one"
            )
    return prefix, entries


def load_hf(hf_dir: str | Path, *, spec: GemmaSpec | None = None, mesh=None, param_dtype=None) -> nnx.State:
    """Load an HF Gemma checkpoint as the Tunix parameter state, tensor by tensor.

    Each Tunix parameter is built from HF tensors read one at a time (renamed, transposed, fused per
    ``gemport.specs.names``) and placed straight into its sharding: with ``mesh``, Tunix's default annotation on
    that mesh (axes ``fsdp`` and ``tp``), each device reading only its slice; without, the default device.
    Peak memory is the loaded state plus one tensor.

    Args:
      hf_dir: directory with ``config.json`` and ``model.safetensors`` or sharded safetensors + index.
      spec: the architecture, if already at hand; default (and checked against) ``hf_dir/config.json``.
      mesh: a ``jax.sharding.Mesh`` with axes ``fsdp`` and ``tp`` (see ``gemport.mesh.make_mesh``).
      param_dtype: parameter dtype (e.g. ``jnp.bfloat16``); default keeps the checkpoint's dtype.

    Returns:
      An ``nnx.State`` of ``nnx.Param`` with the Tunix model's paths, e.g. ``layers.0.attn.q_einsum.w``
      of shape (N, D, H). Vision/audio tensors are ignored (see ``save_hf(base_dir=...)`` to keep them).
    """
    return _load(HFCheckpoint(hf_dir), resolve_spec(hf_dir, spec, "hf_dir"), mesh, param_dtype)[1]


def _load(ckpt: HFCheckpoint, spec: GemmaSpec, mesh, param_dtype) -> tuple[nnx.GraphDef, nnx.State]:
    prefix, entries = matched_entries(ckpt, spec)
    file_dtype = DTYPES[ckpt.info(prefix + "embed_tokens.weight").dtype]
    target = np.dtype(param_dtype) if param_dtype is not None else file_dtype
    graphdef, abstract = nnx.split(abstract_model(spec, param_dtype=target))
    by_path = {e.tunix: e for e in entries}
    flat = []
    for path, var in tqdm(nnx.to_flat_state(abstract), desc="load_hf", unit="tensor", leave=False):
        entry = by_path[path_str(path)]
        shape = var.get_value().shape
        sharding = _sharding(var, mesh)
        flat.append((path, var.replace(_place(ckpt, prefix, entry, shape, target, sharding))))
    return graphdef, nnx.from_flat_state(flat)


def _sharding(var, mesh):
    if mesh is None:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return named_sharding(var, mesh)


def _place(ckpt: HFCheckpoint, prefix: str, entry: names.Entry, shape, dtype, sharding) -> jax.Array:
    if entry.fill is not None:
        return jax.make_array_from_callback(
            shape, sharding, lambda index: np.full(shape, entry.fill, dtype)[index]
        )

    tensor = None

    def read(index):
        # Read on the first device's request and shared by the others, so each tensor is read from disk
        # once and only one is in memory at a time.
        nonlocal tensor
        if tensor is None:
            tensor = entry.to_tunix([ckpt.array(prefix + h) for h in entry.hf]).astype(dtype, copy=False)
        return tensor[index]

    return jax.make_array_from_callback(shape, sharding, read)


def load_model(hf_dir: str | Path, *, spec: GemmaSpec | None = None, mesh=None, param_dtype=None):
    """Load an HF Gemma checkpoint as a ready Tunix model (``tunix.models.gemma3.Gemma3`` or ``gemma4.Gemma4``).

    Loading as in `load_hf`: tensor by tensor, each placed on ``mesh`` as read; the model's compute dtype equals
    its parameter dtype.

    Args:
      hf_dir: an HF checkpoint directory (``config.json`` and safetensors).
      spec: its architecture (default: read from ``config.json``).
      mesh: a ``make_mesh`` mesh to shard the parameters on (default: one device).
      param_dtype: the parameters' dtype (default: the checkpoint's).

    Returns:
      The Tunix model; ``model(tokens int32 [B, T], positions int32 [B, T], None, mask bool [B, T, T])`` gives
      logits float [B, T, V] first.

    Example (``checkpoint``: a tiny Gemma 3 saved by transformers):

      >>> from gemport import load_model
      >>> model = load_model(checkpoint, param_dtype="float32")
      >>> type(model).__name__, model.embedder.input_embedding.get_value().shape
      ('Gemma3', (96, 32))
    """
    ckpt = HFCheckpoint(hf_dir)
    return nnx.merge(*_load(ckpt, resolve_spec(hf_dir, spec, "hf_dir"), mesh, param_dtype))
