"""Adam's scaling with torch.optim.AdamW's bias corrections: ``1 - beta**t`` to float32's precision.

``optax.scale_by_adam`` computes ``1 - b2**t`` in float32, where 0.999 is 0.99900001: the correction is then
1.3e-5 (t = 1) to 2e-5 (t = 2) relative off, and every update of the first steps about 1e-5 too large, a hundred
float32 units, the same sign on every element. torch computes it in Python's float64. Here it is
``-expm1(t * log(beta))`` with the logarithm taken in float64: a few float32 units from the exact value.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax


def _log(beta: float) -> float:
    return math.log(beta) if beta > 0 else -math.inf  # beta 0: no averaging, a correction of 1


def scale_by_torch_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> optax.GradientTransformation:
    """``optax.scale_by_adam(b1, b2, eps)`` (same state, ``optax.ScaleByAdamState``) with its bias corrections
    computed as ``torch.optim.AdamW`` computes them, to float32's precision.

    Args:
      b1, b2: the moments' decay rates, in [0, 1).
      eps: added to the corrected second moment's square root.

    Returns:
      A transformation mapping gradients to ``m_hat / (sqrt(v_hat) + eps)``, each leaf of the params' shape.

    Example::

        tx = optax.chain(scale_by_torch_adam(0.9, 0.999, 1e-8), optax.scale_by_learning_rate(1e-3))
    """
    log_b1, log_b2 = _log(b1), _log(b2)

    def init_fn(params):
        return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=optax.tree.zeros_like(params),
                                      nu=optax.tree.zeros_like(params))

    def update_fn(updates, state, params=None):
        del params
        mu = optax.tree.update_moment(updates, state.mu, b1, 1)
        nu = optax.tree.update_moment_per_elem_norm(updates, state.nu, b2, 2)
        count = optax.safe_increment(state.count)
        t = count.astype(jnp.float32)
        c1, c2 = -jnp.expm1(t * log_b1), -jnp.expm1(t * log_b2)
        updates = jax.tree.map(lambda m, v: (m / c1.astype(m.dtype)) / (jnp.sqrt(v / c2.astype(v.dtype)) + eps),
                               mu, nu)
        return updates, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(init_fn, update_fn)
