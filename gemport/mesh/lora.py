"""Sharding of Qwix LoRA params, derived from the base weight and the contraction that uses it.

Each LoRA factor's axis is one of its base weight's axes (it keeps that axis' spec entry) or the rank axis
(never sharded): `gemport.lora.factor_specs`. Which axes a factor has is read from the module: the LoRA
einsum Qwix (and `gemport.lora.Provider`) records as ``<w>_lora_einsum_str``, e.g. ``"BSD,CDr,CrKH->CBSKH"``
for kv_einsum's separate factors; for ``nnx.Linear`` (in, out): ``lora_a`` (in, r), ``lora_b`` (r, out).
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from gemport.errors import MeshError
from gemport.lora import factor_axes, factor_specs
from gemport._src.partition import Spec, axes_of, padded, shards, spec_of
from gemport._src.pattern import Equation


def _factor_axes(module, base_name: str, path: str) -> tuple[str, str, str]:
    """Axis letters of (base weight, ``lora_a``, ``lora_b``) on ``module``, e.g. ``("NDH", "Dr", "rNH")``."""
    if isinstance(module, nnx.Linear) and base_name == "kernel":
        return "io", "ir", "ro"
    equation = getattr(module, "einsum_str", None)
    if not isinstance(equation, str) or base_name != "w":
        raise MeshError(
            f"{path}: cannot tell which axes of {base_name!r} feed lora_a on a {type(module).__name__}; fix_lora "
            "knows Tunix Einsum modules (weight 'w', equation 'einsum_str') and nnx.Linear (weight 'kernel')"
        )
    x, weight = Equation.parse(equation).inputs
    recorded = getattr(module, base_name + "_lora_einsum_str", None)
    if isinstance(recorded, str):
        _, a, b = Equation.parse(recorded).inputs
        return weight, a, b
    a, b = factor_axes(weight, x)
    return weight, "".join(a), "".join(b)


@dataclasses.dataclass(frozen=True)
class LoraChange:
    """One repaired LoRA annotation: ``path`` went from ``old`` to ``new`` spec, and why."""

    path: str
    shape: tuple[int, ...]
    old: Spec
    new: Spec
    reason: str

    def __str__(self):
        return f"{self.path} {list(self.shape)}: {self.old} -> {self.new} ({self.reason})"


def _divisible(spec: Spec, shape, mesh) -> tuple[Spec, list[str]]:
    """``spec`` with every entry that does not divide its dimension (or names no mesh axis) replaced by None."""
    sizes = dict(mesh.shape)
    out, notes = [], []
    for dim, (size, entry) in enumerate(zip(shape, spec)):
        unknown = [a for a in axes_of(entry) if a not in sizes]
        if unknown:
            notes.append(f"dim {dim} names axis {unknown[0]!r} that mesh {tuple(sizes)} lacks: replicated")
            entry = None
        elif size % shards(entry, sizes):
            notes.append(f"dim {dim} of size {size} does not divide by {entry}={shards(entry, sizes)}: replicated")
            entry = None
        out.append(entry)
    return tuple(out), notes


def _lora_params(module):
    for name, value in vars(module).items():
        if name.endswith("_lora_a") and isinstance(value, nnx.LoRAParam):
            yield name[: -len("_lora_a")], value, getattr(module, name[: -len("_lora_a")] + "_lora_b")


def fix_lora(model: nnx.Module, mesh: jax.sharding.Mesh) -> tuple[LoraChange, ...]:
    """Repair the sharding annotations (and placement) of every Qwix LoRA param of ``model`` in place.

    For each ``<w>_lora_a`` / ``<w>_lora_b`` pair the wanted spec is derived from the base weight's
    ``out_sharding`` and the factor's axes (`gemport.lora.factor_axes`, or the LoRA einsum the module records); any entry whose axes do not divide its
    dimension on ``mesh``, or that names an axis ``mesh`` lacks, is replicated (that dimension only). A
    param whose annotation differs is re-annotated and, when it holds a concrete array, moved to
    ``NamedSharding(mesh, new_spec)``. Base weights are read, never changed.

    Args:
      model: an ``nnx.Module`` with Qwix LoRA (its modules carry the einsum equations that decide each factor's
        axes), concrete or abstract (``nnx.eval_shape``: then only annotations change).
      mesh: the mesh to place the factors on; its axis sizes decide which entries divide.

    Returns:
      One ``LoraChange`` per param re-annotated or moved, and per param with a dimension left replicated
      because it does not divide (even if it already was): old and new spec and the reason. () if every
      LoRA param already matched its base weight.

    Raises:
      MeshError: ``model`` is not an ``nnx.Module``; a base weight's annotation is longer than its rank; a
        module whose factors' axes cannot be told (neither a Tunix ``Einsum`` nor an ``nnx.Linear``).
    """
    if not isinstance(model, nnx.Module):
        raise MeshError(
            f"fix_lora needs the model (an nnx.Module), got {type(model).__name__}: the einsum equations that "
            "decide each LoRA factor's layout live on the modules, not in a state"
        )
    changes = []
    for module_path, module in nnx.iter_modules(model):
        for base_name, lora_a, lora_b in _lora_params(module):
            prefix = ".".join(map(str, module_path))
            base = getattr(module, base_name)
            shape = base.get_value().shape
            base_spec = spec_of(base)
            if len(base_spec) > len(shape):
                raise MeshError(
                    f"{prefix}.{base_name}: base weight of shape {list(shape)} is annotated {base_spec}, longer "
                    "than its rank; fix the base weight's annotation first (see gemport.mesh.audit)"
                )
            weight_axes, a_axes, b_axes = _factor_axes(module, base_name, prefix)
            wanted = factor_specs(weight_axes, base_spec, a_axes, b_axes)
            for suffix, var, spec in (("_lora_a", lora_a, wanted[0]), ("_lora_b", lora_b, wanted[1])):
                change = _apply(f"{prefix}.{base_name}{suffix}", var, spec, mesh)
                if change is not None:
                    changes.append(change)
    return tuple(changes)


def _apply(path: str, var: nnx.Variable, wanted: Spec, mesh) -> LoraChange | None:
    value = var.get_value()
    spec, notes = _divisible(wanted, value.shape, mesh)
    old = spec_of(var)
    sharding = NamedSharding(mesh, PartitionSpec(*spec))
    misplaced = isinstance(value, jax.Array) and not value.sharding.is_equivalent_to(sharding, value.ndim)
    if len(old) > value.ndim:
        reason = f"spec of length {len(old)} on a rank-{value.ndim} array"
    elif padded(old, value.ndim) != spec:
        reason = "differs from the base weight's layout"
    elif misplaced:
        reason = f"array was placed as {value.sharding}"
    elif notes:
        reason = "annotation already replicated there"
    else:
        return None
    var.set_metadata("out_sharding", spec)
    if misplaced:
        var.set_value(jax.device_put(value, sharding))
    return LoraChange(path, tuple(value.shape), old, spec, "; ".join([reason, *notes]))
