"""Shardings for Optax state, derived from the shardings of the params it tracks."""

from __future__ import annotations

import jax
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from gemport.errors import MeshError
from gemport._src.partition import named_sharding


def optimizer_shardings(tx: optax.GradientTransformation, params, mesh: jax.sharding.Mesh | None = None):
    """A ``NamedSharding`` for every leaf of ``tx.init(params)``, so the state can be placed before the first jit.

    A state leaf with a param's shape, under a path ending in that param's path (Adam's ``mu`` and ``nu``,
    ``MultiSteps``' ``acc_grads``, the inner state of ``inject_hyperparams`` or ``masked``), takes that param's
    sharding. Every other leaf must be a scalar (``count``, hyperparameters, ``mini_step``) and is replicated.

    Args:
      tx: any Optax transformation (the state is built with ``jax.eval_shape``: no memory is used).
      params: the pytree ``tx`` updates: arrays or ``jax.ShapeDtypeStruct`` with ``NamedSharding``, or an
        ``nnx.State`` (e.g. ``nnx.state(model, nnx.LoRAParam)``), whose ``out_sharding`` annotations are used.
      mesh: the mesh of the annotations; needed when ``params`` carries annotations but no placed arrays.

    Returns:
      The pytree of ``jax.eval_shape(tx.init, params)`` with a ``NamedSharding`` at each leaf; pass it as
      ``out_shardings`` of ``jax.jit(tx.init)``.

    Raises:
      MeshError: a non-scalar state leaf matches no param (e.g. Adafactor's factored moments).
    """
    mesh = mesh or _mesh_of(params)
    by_path = dict(jax.tree_util.tree_flatten_with_path(_param_shardings(params, mesh))[0])
    shapes = {path: leaf.shape for path, leaf in jax.tree_util.tree_flatten_with_path(_values(params))[0]}
    state = jax.eval_shape(tx.init, _values(params))

    def sharding(path, leaf):
        for start in range(len(path)):
            tail = tuple(path[start:])
            if tail in by_path and shapes[tail] == leaf.shape:
                return by_path[tail]
        if leaf.ndim:
            raise MeshError(
                f"optimizer state {jax.tree_util.keystr(path)} of shape {list(leaf.shape)} matches no param; "
                "give its sharding by hand (optimizer_shardings derives shardings of param-shaped state only)"
            )
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree_util.tree_map_with_path(sharding, state)


def _values(params):
    return jax.tree.map(
        lambda v: v.get_value() if isinstance(v, nnx.Variable) else v,
        params,
        is_leaf=lambda v: isinstance(v, nnx.Variable),
    )


def _param_shardings(params, mesh):
    def one(v):
        if isinstance(v, nnx.Variable):
            return named_sharding(v, mesh)
        sharding = getattr(v, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree.map(one, params, is_leaf=lambda v: isinstance(v, nnx.Variable))


def _mesh_of(params):
    for leaf in jax.tree.leaves(_values(params)):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    raise MeshError("no param is placed with a NamedSharding; pass mesh= to optimizer_shardings")
