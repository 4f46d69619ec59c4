"""Tunix parameter states <-> Orbax checkpoints, placed on a mesh on restore."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from gemport.checkpoint.load import abstract_model
from gemport.checkpoint.output import check_output
from gemport.errors import CheckpointError, ShapeMismatchError
from gemport.specs import GemmaSpec


def save_orbax(state_or_model, out_dir: str | Path) -> Path:
    """Save a Tunix model's parameters (or an ``nnx.State``) as an Orbax checkpoint at ``out_dir``.

    Orbax writes into a temporary directory and renames it when complete. ``out_dir`` must not exist.
    """
    import orbax.checkpoint as ocp

    state = nnx.state(state_or_model, nnx.Param) if isinstance(state_or_model, nnx.Module) else state_or_model
    out = check_output(out_dir)
    if out.exists():
        out.rmdir()
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(out, state)
        checkpointer.wait_until_finished()
    return out


def load_orbax(path: str | Path, spec: GemmaSpec, *, mesh=None, dtype=None) -> nnx.State:
    """Restore a Tunix parameter state saved by ``save_orbax`` (or Tunix), checked against ``spec``.

    Args:
      path: the Orbax checkpoint directory.
      spec: the architecture; every stored parameter must have the shape the spec implies.
      mesh: place each parameter with Tunix's default annotation on this mesh; default the first device.
      dtype: restore as this dtype; default the stored one.

    Returns:
      An ``nnx.State`` of ``nnx.Param``, as from ``gemport.checkpoint.load_hf``.
    """
    import orbax.checkpoint as ocp

    path = Path(path).resolve()
    with ocp.StandardCheckpointer() as checkpointer:
        try:
            stored = checkpointer.metadata(path).item_metadata.tree
        except (FileNotFoundError, ValueError, KeyError) as e:
            raise CheckpointError(f"{path}: not a readable Orbax checkpoint ({e})") from None
        leaves = jax.tree.leaves(stored)
        target_dtype = np.dtype(dtype) if dtype is not None else np.dtype(leaves[0].dtype)
        graphdef, abstract = nnx.split(abstract_model(spec, param_dtype=target_dtype))
        flat = []
        for p, var in nnx.to_flat_state(abstract):
            annotation = var.get_metadata().get("out_sharding") or ()
            sharding = (NamedSharding(mesh, PartitionSpec(*annotation)) if mesh is not None
                        else jax.sharding.SingleDeviceSharding(jax.devices()[0]))
            value = var.get_value()
            flat.append((p, var.replace(jax.ShapeDtypeStruct(value.shape, target_dtype, sharding=sharding))))
        target = nnx.from_flat_state(flat)
        try:
            return checkpointer.restore(path, target)
        except ValueError as e:
            raise ShapeMismatchError(f"{path}: does not hold the parameters of this spec ({e})") from None
