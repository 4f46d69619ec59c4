"""One row per parameter: what its annotation asks for on a mesh, what that costs, and what is wrong with it."""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from gemport._src.partition import Spec, axes_of, bytes_per_device, padded, shards, spec_of

LARGE_BYTES = 2**20


@dataclasses.dataclass(frozen=True)
class AuditRow:
    """One parameter (or optimizer state) on a mesh.

    Attributes:
      path: dotted nnx path, e.g. ``layers.5.attn.k_einsum.w_lora_b``.
      shape, dtype: of the array.
      spec: its ``out_sharding`` annotation as written (may be shorter than the rank: trailing dims replicated).
      bytes_per_device: bytes each device holds under ``spec`` (indivisible dims counted padded, as JAX does).
      findings: what is wrong, empty when nothing is: ``spec longer than rank``, ``unknown axis``,
        ``indivisible``, ``large tensor replicated``, ``placed as`` (the array sits in another sharding).
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: Spec
    bytes_per_device: int
    findings: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Audit:
    """The rows of ``audit``; ``str()`` renders them as a table, problems first marked ``!``."""

    rows: tuple[AuditRow, ...]

    def __iter__(self):
        return iter(self.rows)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, path: str) -> AuditRow:
        for row in self.rows:
            if row.path == path:
                return row
        raise KeyError(path)

    @property
    def problems(self) -> tuple[AuditRow, ...]:
        return tuple(r for r in self.rows if r.findings)

    @property
    def bytes_per_device(self) -> int:
        return sum(r.bytes_per_device for r in self.rows)

    def __str__(self):
        header = ("", "path", "shape", "dtype", "spec", "bytes/device", "finding")
        body = [
            (
                "!" if r.findings else "",
                r.path,
                "x".join(map(str, r.shape)) or "()",
                r.dtype,
                str(PartitionSpec(*r.spec)),
                f"{r.bytes_per_device:,}",
                "; ".join(r.findings),
            )
            for r in self.rows
        ]
        body.append(("", "total", "", "", "", f"{self.bytes_per_device:,}", f"{len(self.problems)} with findings"))
        widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
        return "\n".join(
            "  ".join(cell.rjust(w) if i == 5 else cell.ljust(w) for i, (cell, w) in enumerate(zip(line, widths)))
            .rstrip()
            for line in [header, *body]
        )


def audit(state, mesh: jax.sharding.Mesh, *, large_bytes: int = LARGE_BYTES) -> Audit:
    """Check every variable of ``state`` (an ``nnx.Module``, ``nnx.Optimizer`` or ``nnx.State``) against ``mesh``.

    Reads each variable's ``out_sharding`` annotation and its shape; changes nothing (`gemport.mesh.fix_lora`
    repairs LoRA factors).

    Args:
      state: the model, optimizer or state to check; concrete or abstract (``nnx.eval_shape``): the ``placed as``
        finding needs arrays.
      mesh: the mesh the annotations are read against, e.g. from `gemport.make_mesh`.
      large_bytes: the bytes per device from which a fully replicated tensor is reported (on a mesh of more than
        one device); default 1 MiB.

    Returns:
      An `Audit`: one `AuditRow` per variable in ``nnx.to_flat_state`` order (path, shape, dtype, spec, bytes per
      device, findings); ``problems`` are the rows with findings, ``bytes_per_device`` their sum, ``str()`` a
      table.

    Example (``checkpoint``: a tiny Gemma 3 saved by transformers; two devices, e.g. a CPU with
    ``XLA_FLAGS=--xla_force_host_platform_device_count=2``):

      >>> import jax
      >>> from gemport import GemmaSpec, audit, load_model, make_mesh
      >>> mesh = make_mesh(GemmaSpec.from_hf(checkpoint), fsdp=2, tp=1, devices=jax.devices()[:2])
      >>> model = load_model(checkpoint, mesh=mesh)
      >>> report = audit(model, mesh)
      >>> len(report), report.problems
      (74, ())
      >>> row = report["layers.0.attn.q_einsum.w"]  # [N, D, H] float32, D split over fsdp
      >>> row.shape, row.spec, row.bytes_per_device
      ((4, 32, 8), ('tp', 'fsdp', None), 2048)
      >>> model.layers[0].attn.q_einsum.w.set_metadata("out_sharding", ("tp", "data", None))
      >>> audit(model, mesh)["layers.0.attn.q_einsum.w"].findings
      ("unknown axis 'data' (mesh has fsdp, tp)",)
    """
    if not isinstance(state, nnx.State):
        state = nnx.state(state)
    rows = [_row(path, var, mesh, large_bytes) for path, var in nnx.to_flat_state(state)]
    return Audit(tuple(rows))


def _row(path, var, mesh, large_bytes) -> AuditRow:
    value = var.get_value() if isinstance(var, nnx.Variable) else var
    spec = spec_of(var) if isinstance(var, nnx.Variable) else ()
    shape, sizes = tuple(value.shape), dict(mesh.shape)
    dtype = value.dtype  # not np.dtype: PRNG key arrays (nnx.Rngs) have JAX's extended key dtypes
    findings = []
    if len(spec) > len(shape):
        findings.append(f"spec longer than rank ({len(spec)} > {len(shape)})")
    unknown = sorted({a for e in spec for a in axes_of(e) if a not in sizes})
    if unknown:
        findings.append(f"unknown axis {', '.join(map(repr, unknown))} (mesh has {', '.join(sizes)})")
    usable = tuple(None if any(a not in sizes for a in axes_of(e)) else e for e in spec[: len(shape)])
    for dim, (size, entry) in enumerate(zip(shape, usable)):
        if size % shards(entry, sizes):
            findings.append(f"indivisible: dim {dim} of size {size} by {entry}={shards(entry, sizes)}")
    nbytes = bytes_per_device(shape, usable, sizes, dtype.itemsize)
    if all(e is None for e in usable) and nbytes >= large_bytes and mesh.size > 1:
        findings.append(f"large tensor replicated ({nbytes:,} bytes on every device)")
    if not findings and isinstance(value, jax.Array):
        wanted = NamedSharding(mesh, PartitionSpec(*padded(usable, len(shape))))
        if not value.sharding.is_equivalent_to(wanted, len(shape)):
            findings.append(f"placed as {value.sharding}")
    return AuditRow(".".join(map(str, path)), shape, str(dtype), spec, nbytes, tuple(findings))
