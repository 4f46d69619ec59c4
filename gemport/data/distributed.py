"""Each process's part of HF's global batches, and global arrays assembled from those parts.

Under ``jax.distributed`` (one process per host) every process runs the same program on a mesh spanning all
of them, and each feeds only the rows its own devices hold. The global batch of an optimizer step is the
single-process one: HF's sample order (``optimizer_steps``) cut into micro-batches of B rows. A step's batch
[A, B, T] is sharded along its rows (``batch_sharding``); ``process_rows`` says which rows a process holds,
``process_step`` cuts an ``OptimizerStep``'s sample indices to them, and ``global_batch`` joins the
processes' [A, B_p, T] into the global [A, B, T] array ``train_step`` takes. The union over processes is the
single-process batch, row for row, so training is the single-process run's up to the order of reductions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from gemport.errors import BatchError
from gemport.mesh.dims import FSDP
from gemport.data.order import OptimizerStep


def batch_sharding(mesh: jax.sharding.Mesh, axes: str | tuple[str, ...] = FSDP) -> NamedSharding:
    """The sharding of a step's batch [A, B, T]: rows B split over mesh ``axes`` (Tunix's data axis, fsdp),
    micro-batches A and tokens T whole on every device."""
    return NamedSharding(mesh, PartitionSpec(None, axes, None))


def device_rows(sharding: Sharding, shape: tuple[int, ...], devices: Iterable[jax.Device], *, axis: int = 1) -> slice:
    """The rows (indices along ``axis``) of a global array of ``shape`` that ``devices`` hold under ``sharding``.

    They must be one contiguous range (as they are when the data axes run across processes in mesh order,
    which ``make_mesh`` and ``jax.make_mesh`` give); other dimensions may be sharded too.

    Raises:
      BatchError: the devices hold no rows, or rows that are not one range.
    """
    size = shape[axis]
    held = set()
    indices = sharding.devices_indices_map(tuple(shape))
    for device in devices:
        start, stop, _ = indices[device][axis].indices(size)
        held.update(range(start, stop))
    if not held or len(held) != max(held) - min(held) + 1:
        raise BatchError(
            f"the devices {sorted(d.id for d in devices)} hold rows {sorted(held)} of {size}; a process must hold "
            "one contiguous range of the batch's rows: shard the rows over the mesh's leading (data) axes"
        )
    return slice(min(held), max(held) + 1)


def process_rows(sharding: Sharding, shape: tuple[int, ...], *, axis: int = 1) -> slice:
    """The rows of a global batch of ``shape`` this process's devices hold (``device_rows`` of its devices)."""
    return device_rows(sharding, shape, sharding.addressable_devices, axis=axis)


def process_step(step: OptimizerStep, rows: slice) -> OptimizerStep:
    """``step`` with each micro-batch's sample indices cut to ``rows``: the samples this process lays out.

    A short micro-batch (the end of an epoch) may leave a process fewer rows, or none: ``stack(...,
    rows=rows.stop - rows.start)`` pads them with empty rows, as the single-process batch has there.
    """
    return step._replace(micro_batches=tuple(m[rows] for m in step.micro_batches))


def global_batch(local: Mapping[str, np.ndarray], sharding: Sharding, rows: int | None, *,
                 axis: int = 1) -> dict[str, jax.Array]:
    """The global arrays of a step's batch from this process's rows.

    local: each field [A, B_p, T], the rows ``process_rows`` gave this process (or, with ``axis=0``, a
    micro-batch's [B_p, ...]); rows: the global B (None: as ``sharding`` implies from B_p).
    Returns each field [A, B, T] as a ``jax.Array`` under ``sharding``
    (``jax.make_array_from_process_local_data``: no process sends its rows to another).
    """
    out = {}
    for name, value in local.items():
        shape = list(np.shape(value))
        shape[axis] = rows
        out[name] = jax.make_array_from_process_local_data(sharding, np.asarray(value),
                                                           None if rows is None else tuple(shape))
    return out


__all__ = ["batch_sharding", "device_rows", "global_batch", "process_rows", "process_step"]
