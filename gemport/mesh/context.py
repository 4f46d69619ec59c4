"""The mesh context a training run needs: JAX's current mesh and the physical mesh Tunix reads."""

import contextlib
import warnings
from collections.abc import Iterator

import jax


@contextlib.contextmanager
def use_mesh(mesh: jax.sharding.Mesh | None) -> Iterator[None]:
    """``mesh`` as JAX's current mesh (``jax.set_mesh``) and as the physical mesh (``with mesh:``).

    Tunix's ``PeftTrainer`` shards its batches and optimizer on ``pxla.thread_resources.env.physical_mesh``,
    which only ``with mesh:`` sets (deprecated in JAX 0.10, hence its warning is silenced here); gemport's
    own code and ``nnx.Optimizer`` over annotated params read the current mesh. ``None`` enters nothing.
    """
    if mesh is None:
        yield
        return
    with jax.set_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with mesh:
            yield
