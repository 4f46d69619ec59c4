"""torch's gradient clipping rule as an Optax transformation."""

import jax
import jax.numpy as jnp
import optax

_TORCH_EPS = 1e-6


def clip_grad_norm(max_norm: float) -> optax.GradientTransformation:
    """Map HF's ``max_grad_norm`` (applied with ``torch.nn.utils.clip_grad_norm_``) to Optax.

    Every gradient is multiplied by ``min(1, max_norm / (global_norm + 1e-6))``, the global norm
    being the L2 norm over all leaves. ``optax.clip_by_global_norm`` instead rescales only when the
    norm exceeds ``max_norm`` and by ``max_norm / global_norm``, without torch's epsilon.
    """

    def clip(updates: optax.Updates, params: optax.Params | None = None) -> optax.Updates:
        del params
        factor = jnp.minimum(1.0, max_norm / (optax.tree.norm(updates) + _TORCH_EPS))
        return jax.tree.map(lambda g: (g * factor).astype(g.dtype), updates)

    return optax.stateless(clip)
