"""TPU slices by their Cloud names, as devices XLA compiles for on any host, and the platform a trace targets.

libtpu (``pip install 'gemport[tpu]'``, JAX's own pairing) holds the TPU compiler. With it,
``slice_devices("v5p-8")`` gives the slice's chips as compile-only JAX devices of its topology
(``jax.experimental.topologies``): a step lowered on a mesh of them compiles as it would on the slice, kernels
(splash attention through Mosaic) and memory analysis included, on a host with no TPU. Nothing runs on them.

A slice name is Cloud TPU's accelerator type: ``v5p-N`` counts TensorCores (two per chip, one JAX device per
chip), ``v5litepod-N`` / ``v5e-N`` and ``v6e-N`` count chips. Hosts hold four chips, except the single-host
``v5e-8`` / ``v6e-8`` (eight) and slices smaller than a host.
"""

from __future__ import annotations

import dataclasses
import os
import re

import jax
import numpy as np

from gemport.errors import MeshError

# generation -> (libtpu's topology prefix, TensorCores per chip in the name, torus dimensions)
GENERATIONS = {"v5p": ("v5p", 2, 3), "v5e": ("v5e", 1, 2), "v5litepod": ("v5e", 1, 2), "v6e": ("v6e", 1, 2)}
CHIPS_PER_HOST = 4
SINGLE_HOST_CHIPS = {"v5e": 8, "v6e": 8}
"""Chips of a single-host slice that holds more than ``CHIPS_PER_HOST``."""


def platform() -> str:
    """The platform ("cpu", "gpu", "tpu") of the devices the current trace compiles for: those of the mesh
    set by ``jax.set_mesh`` (a TPU slice's from ``slice_devices`` on a CPU host), else JAX's default backend."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    return device.platform if device is not None else jax.default_backend()


def _shape(chips: int, dims: int) -> tuple[int, ...]:
    # Cloud's torus shapes: 2-D 2x2, 2x4, 4x4, 4x8, ...; 3-D 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, ...: from the
    # smallest, the last of the shortest sides doubles.
    if chips < 4:
        return tuple(chips if i == 1 else 1 for i in range(dims))
    shape = [2, 2, 1][:dims]
    while int(np.prod(shape)) < chips:
        i = max(i for i, s in enumerate(shape) if s == min(shape))
        shape[i] *= 2
    return tuple(shape)


@dataclasses.dataclass(frozen=True)
class TpuSlice:
    """A TPU slice as libtpu describes it.

    Attributes:
      name: Cloud TPU's accelerator type, e.g. "v5p-8".
      generation: the chip, as libtpu and ``mesh.HBM`` name it ("v5p", "v5e", "v6e").
      grid: the chips' torus shape, e.g. (2, 2, 1) for a v5p-8.
      host: the chips one host holds, in the same axes (three of them).
    """

    name: str
    generation: str
    grid: tuple[int, ...]
    host: tuple[int, int, int]

    @property
    def chips(self) -> int:
        """The slice's chips: its JAX devices."""
        return int(np.prod(self.grid))

    @property
    def topology(self) -> str:
        """libtpu's topology name, e.g. "v5p:2x2x1"."""
        return f"{self.generation}:{'x'.join(map(str, self.grid))}"

    @classmethod
    def parse(cls, name: str) -> "TpuSlice":
        """The slice of accelerator type ``name`` ("v5p-8": 4 chips, "v6e-8": 8).

        Raises MeshError for a name that is not ``<generation>-<N>`` of a known generation with a power-of-two
        chip count.
        """
        match = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", name)
        known = ", ".join(f"{g}-N" for g in GENERATIONS)
        if not match or match[1] not in GENERATIONS:
            raise MeshError(f"unknown TPU slice {name!r}: give a Cloud TPU accelerator type ({known}), e.g. v5p-8")
        generation, cores, dims = GENERATIONS[match[1]]
        count = int(match[2])
        chips = count // cores
        if count % cores or chips < 1 or chips & (chips - 1):
            unit = "TensorCores (2 per chip)" if cores == 2 else "chips"
            raise MeshError(f"TPU slice {name!r}: {count} {unit} is not a slice's size; a {match[1]} slice has a "
                            f"power of two chips, e.g. {match[1]}-{4 * cores}")
        host = chips if chips <= SINGLE_HOST_CHIPS.get(generation, CHIPS_PER_HOST) else CHIPS_PER_HOST
        return cls(name, generation, _shape(chips, dims), _shape(host, dims) + (1,) * (3 - dims))


def slice_devices(name: str) -> list:
    """The chips of TPU slice ``name`` (e.g. "v5p-8": 4, "v6e-8": 8) as compile-only JAX devices, for a mesh
    (``make_mesh(..., devices=slice_devices("v5p-8"))``) whose programs compile for that slice on this host.

    Raises MeshError for an unknown slice name, or when libtpu is not installed (``pip install 'gemport[tpu]'``).
    """
    tpu = TpuSlice.parse(name)
    # libtpu reads a TPU VM's metadata and takes a lock on its chips when it loads; a compile-only topology
    # needs neither, and another process (a test worker, a running job) may hold the lock.
    compile_only = {"TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": name, "TPU_WORKER_HOSTNAMES": "localhost",
                    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    for key, value in compile_only.items():
        os.environ.setdefault(key, value)
    from jax.experimental import topologies  # lazy: only a TPU slice's compile-only devices need it

    try:
        return list(topologies.get_topology_desc(topology_name=tpu.topology, platform="tpu",
                                                 chips_per_host_bounds=tpu.host).devices)
    except RuntimeError as e:  # JAX's "TPU support not installed", or libtpu's refusal (JaxRuntimeError)
        if "not installed" in str(e):
            raise MeshError(f"compiling for TPU slice {name!r} needs libtpu, the TPU compiler: pip install "
                            "'gemport[tpu]'") from None
        raise MeshError(f"libtpu cannot describe TPU slice {name!r} ({tpu.topology}): {e}") from None


__all__ = ["TpuSlice", "platform", "slice_devices"]
