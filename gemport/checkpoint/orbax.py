"""Tunix parameter states <-> Orbax checkpoints, placed on a mesh on restore."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
from flax import nnx

import orbax.checkpoint as ocp

from gemport._src.params import abstract_model, path_str
from gemport._src.partition import named_sharding
from gemport.checkpoint.output import atomic_dir, check_output
from gemport.errors import CheckpointError, CorruptFileError, ShapeMismatchError
from gemport.specs import GemmaSpec
from gemport._src.tensors import check_tensors


def save_orbax(state_or_model, out_dir: str | Path) -> Path:
    """Save a Tunix model's parameters (or an ``nnx.State``) as an Orbax checkpoint at ``out_dir``.

    Orbax writes inside a temporary sibling of ``out_dir`` (see `gemport.checkpoint.output.atomic_dir`),
    renamed into place when complete; an unwritable location fails before Orbax starts. ``out_dir`` must not
    exist or be empty. One process writes (conversions, not multi-host training checkpoints).

    Args:
      state_or_model: a Tunix model, whose ``nnx.Param`` state is saved, or any ``nnx.State`` (e.g. of
        ``nnx.LoRAParam``), saved as it is: each array with its shape and dtype.
      out_dir: the checkpoint directory to create; must not exist or be empty.

    Returns:
      The path of the checkpoint directory, resolved; `load_orbax` (a model's parameters) or `gemport.checkpoint.
      load_lora` (LoRA factors, under a ``model_params`` directory) reads it back.

    Raises:
      CheckpointError: the location is not writable, or Orbax failed (disk full...); names ``out_dir``.

    Example (``checkpoint``: a tiny Gemma 3 saved by transformers):

      >>> import tempfile
      >>> import jax
      >>> import numpy as np
      >>> from gemport import GemmaSpec, load_hf, load_orbax, save_orbax
      >>> spec = GemmaSpec.from_hf(checkpoint)
      >>> state = load_hf(checkpoint, spec=spec)
      >>> tmp = tempfile.TemporaryDirectory()
      >>> path = save_orbax(state, f"{tmp.name}/params")
      >>> jax.tree.all(jax.tree.map(np.array_equal, state, load_orbax(path, spec=spec)))
      True
      >>> tmp.cleanup()
    """
    state = nnx.state(state_or_model, nnx.Param) if isinstance(state_or_model, nnx.Module) else state_or_model
    out = check_output(out_dir)
    with atomic_dir(out) as tmp:
        inner = tmp / "checkpoint"  # Orbax's own temporary folder then lands inside ours
        try:
            with ocp.StandardCheckpointer() as checkpointer:
                checkpointer.save(inner, state)
                checkpointer.wait_until_finished()
        except Exception as e:
            raise CheckpointError(f"output {out}: Orbax could not write the checkpoint ({e})") from None
        for child in inner.iterdir():
            child.rename(tmp / child.name)
        inner.rmdir()
    return out


def stored_tree(checkpointer, path: Path):
    """The metadata tree of the Orbax checkpoint at ``path``, or ``CorruptFileError`` naming it."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such Orbax checkpoint directory")
    try:
        metadata = checkpointer.metadata(path)
    except Exception as e:
        raise CorruptFileError(f"{path}: not a readable Orbax checkpoint ({e})") from None
    tree = getattr(getattr(metadata, "item_metadata", metadata), "tree", None)
    if not tree:
        raise CorruptFileError(
            f"{path}: not a readable Orbax checkpoint (no _METADATA describing its arrays); it is incomplete "
            "or not an Orbax checkpoint"
        )
    return tree


def load_orbax(path: str | Path, *, spec: GemmaSpec, mesh=None, param_dtype=None) -> nnx.State:
    """Restore a Tunix parameter state saved by ``save_orbax`` (or Tunix), checked against ``spec``.

    Args:
      path: the Orbax checkpoint directory.
      spec: the architecture; every stored parameter must have the shape the spec implies.
      mesh: place each parameter with Tunix's default annotation on this mesh; default the first device.
      param_dtype: restore as this dtype; default the stored one.

    Returns:
      An ``nnx.State`` of ``nnx.Param``, as from ``gemport.checkpoint.load_hf``.
    """
    path = Path(path).resolve()
    with ocp.StandardCheckpointer() as checkpointer:
        stored = stored_tree(checkpointer, path)
        leaves = jax.tree.leaves(stored)
        target_dtype = np.dtype(param_dtype) if param_dtype is not None else np.dtype(leaves[0].dtype)
        graphdef, abstract = nnx.split(abstract_model(spec, param_dtype=target_dtype))
        flat = []
        for p, var in nnx.to_flat_state(abstract):
            sharding = (named_sharding(var, mesh) if mesh is not None
                        else jax.sharding.SingleDeviceSharding(jax.devices()[0]))
            value = var.get_value()
            flat.append((p, var.replace(jax.ShapeDtypeStruct(value.shape, target_dtype, sharding=sharding))))
        _check_shapes(path, stored, flat)
        target = nnx.from_flat_state(flat)
        try:
            return checkpointer.restore(path, target)
        except ValueError as e:
            raise ShapeMismatchError(f"{path}: does not hold the parameters of this spec ({e})") from None
        except Exception as e:
            raise CorruptFileError(f"{path}: Orbax could not read the checkpoint's arrays ({e})") from None


def _check_shapes(path: Path, stored, flat) -> None:
    """Every parameter the spec needs, with its shape, and nothing else: before Orbax restores anything."""
    found = {}
    for keys, leaf in jax.tree_util.tree_flatten_with_path(stored)[0]:
        parts = [str(getattr(k, "key", getattr(k, "idx", k))) for k in keys]
        found[".".join(parts[:-1] if parts[-1] == "value" else parts)] = tuple(getattr(leaf, "shape", ()))
    check_tensors(
        found,
        {path_str(p): tuple(v.get_value().shape) for p, v in flat},
        source=str(path),
        fix="the checkpoint is of another model or spec (LoRA params in it: export those with export_merged)",
    )