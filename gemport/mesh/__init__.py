"""Meshes that fit the model: axes, factories, the mesh context and TPU slices.

Tunix annotates every Gemma parameter with a spec over the axes ``fsdp`` and ``tp`` (e.g. ``q_einsum``
(N, D, H) -> ("tp", "fsdp", None)). A mesh fits when every dimension an axis shards divides by that axis'
size. ``sharded_dims`` lists those dimensions, read from the annotations of the Tunix model itself (built
abstractly), named with the ``gemport.specs.names`` axis letters; ``make_mesh`` and ``valid_tp`` check against it.
``slice_devices`` gives a TPU slice's chips (``TpuSlice``, by Cloud name) as compile-only devices, for meshes
compiled on any host. What each device holds on a mesh is planned by ``gemport.plan``.

Sharding checks and repairs for Tunix Gemma models with Qwix LoRA on the mesh: ``audit`` (one row per parameter:
path, shape, dtype, spec, bytes per device, findings), ``fix_lora`` (every LoRA factor's annotation re-derived
from its base weight and its axes) and ``optimizer_shardings`` (Optax state shardings from the params').
"""

from gemport.errors import MeshError
from gemport.mesh.audit import Audit, AuditRow, audit
from gemport.mesh.context import use_mesh
from gemport.mesh.dims import ShardedDim, sharded_dims
from gemport.mesh.factory import make_mesh, valid_tp
from gemport.mesh.lora import LoraChange, fix_lora
from gemport.mesh.optimizer import optimizer_shardings
from gemport.mesh.tpu import TpuSlice, slice_devices

__all__ = [
    "Audit",
    "AuditRow",
    "LoraChange",
    "MeshError",
    "ShardedDim",
    "TpuSlice",
    "audit",
    "fix_lora",
    "make_mesh",
    "optimizer_shardings",
    "sharded_dims",
    "slice_devices",
    "use_mesh",
    "valid_tp",
]
