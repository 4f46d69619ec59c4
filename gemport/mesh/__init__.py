"""Meshes that fit the model, and what each device will hold on them.

Tunix annotates every Gemma parameter with a spec over the axes ``fsdp`` and ``tp`` (e.g. ``q_einsum``
(N, D, H) -> ("tp", "fsdp", None)). A mesh fits when every dimension an axis shards divides by that axis'
size. ``sharded_dims`` lists those dimensions, read from the annotations of the Tunix model itself (built
abstractly), named with the ``gemport.names`` axis letters; ``make_mesh`` and ``valid_meshes`` check against
it, and ``memory_plan`` sums the per-device bytes of the same annotated shapes. ``slice_devices`` gives a
TPU slice's chips (``TpuSlice``, by Cloud name) as compile-only devices, for meshes compiled on any host.
"""

from gemport.errors import MeshError
from gemport.mesh.context import use_mesh
from gemport.mesh.dims import ShardedDim, sharded_dims
from gemport.mesh.factory import make_mesh, valid_tp
from gemport.mesh.plan import HBM, MemoryPlan, compiled_peak, memory_plan, valid_meshes
from gemport.mesh.tpu import TpuSlice, slice_devices

__all__ = [
    "HBM",
    "MemoryPlan",
    "MeshError",
    "ShardedDim",
    "TpuSlice",
    "compiled_peak",
    "make_mesh",
    "memory_plan",
    "sharded_dims",
    "slice_devices",
    "use_mesh",
    "valid_meshes",
    "valid_tp",
]
