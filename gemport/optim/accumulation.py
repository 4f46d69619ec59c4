"""Gradient accumulation normalised by the token count of the whole accumulated batch."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class AccumulateTokensState(NamedTuple):
    """State of ``accumulate_tokens``: the micro-batch index, running sums, and the inner state."""

    micro_step: jax.Array
    num_tokens: jax.Array
    grad_sum: optax.Updates
    inner_state: optax.OptState


def accumulate_tokens(inner: optax.GradientTransformation, steps: int) -> optax.GradientTransformationExtraArgs:
    """Map HF's ``gradient_accumulation_steps`` with its token-count loss normalisation to Optax.

    HF's Trainer sums the per-token losses of ``steps`` micro-batches and divides by the number of
    trained tokens in all of them together (``num_items_in_batch``), so a micro-batch weighs by its
    token count. ``optax.MultiSteps`` instead averages per-micro-batch gradients, each already
    normalised by its own count, which weighs every micro-batch equally.

    Call ``update(grads, state, params, num_tokens=n)`` once per micro-batch, with ``grads`` the
    gradient of the micro-batch's *summed* token loss and ``n`` its number of trained tokens. Every
    ``steps``-th call applies ``inner`` to ``sum(grads) / sum(n)`` and returns its updates; the
    other calls return zeros and leave ``inner``'s state (its step count, hence its learning-rate
    schedule) untouched. Other keyword arguments are passed on to ``inner``. The running sum is kept
    in the parameters' dtype, as torch accumulates ``.grad``; updates come in the gradients' dtype.
    """

    def init(params: optax.Params) -> AccumulateTokensState:
        return AccumulateTokensState(
            micro_step=jnp.zeros([], jnp.int32),
            num_tokens=jnp.zeros([], jnp.int32),
            grad_sum=jax.tree.map(jnp.zeros_like, params),
            inner_state=inner.init(params),
        )

    def update(updates: optax.Updates, state: AccumulateTokensState, params: optax.Params | None = None, *,
               num_tokens: jax.typing.ArrayLike, **extra_args: Any) -> tuple[optax.Updates, AccumulateTokensState]:
        # Sums stay in the parameters' dtype, as torch accumulates .grad, so the state's type is fixed.
        grad_sum = jax.tree.map(lambda s, g: (s + g).astype(s.dtype), state.grad_sum, updates)
        total = state.num_tokens + jnp.asarray(num_tokens, jnp.int32)
        last = state.micro_step == steps - 1

        def apply():
            mean = jax.tree.map(lambda g: g / total, grad_sum)
            inner_updates, inner_state = inner.update(mean, state.inner_state, params, **extra_args)
            # Both branches of the cond must agree on dtypes: every call returns the gradients' dtype.
            return jax.tree.map(lambda u, g: u.astype(g.dtype), inner_updates, updates), inner_state

        def hold():
            return jax.tree.map(jnp.zeros_like, updates), state.inner_state

        new_updates, inner_state = jax.lax.cond(last, apply, hold)
        return new_updates, AccumulateTokensState(
            micro_step=(state.micro_step + 1) % steps,
            num_tokens=jnp.where(last, 0, total),
            grad_sum=jax.tree.map(lambda g: jnp.where(last, jnp.zeros_like(g), g), grad_sum),
            inner_state=inner_state,
        )

    return optax.GradientTransformationExtraArgs(init, update)
