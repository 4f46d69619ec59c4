"""One DPO optimizer step as TRL's ``DPOTrainer`` (on HF's Trainer) takes it.

TRL scales its loss for gradient accumulation by the number of micro-batches (``loss_is_scaled_for_ga=False``:
HF divides each micro-batch's mean per-pair loss by the step's micro-batch count), so the step's gradient is the
mean over micro-batches of each one's gradient, clipped and applied once; TRL logs each micro-batch's metrics
and averages them when it logs.
"""

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from gemport.dpo.loss import METRICS, DPOLoss, dpo_loss
from gemport.train.step import BATCH_FIELDS


def dpo_step(loss: DPOLoss, *, wrt: Any = nnx.LoRAParam) -> Callable[..., dict[str, jax.Array]]:
    """A DPO optimizer step for a Tunix Gemma with LoRA, jit-compiled once per batch shape.

    loss: ``DPOLoss`` (``from_dpo_config``); wrt: what is trained (the ``nnx.Optimizer``'s ``wrt``).
    Returns ``step(model, optimizer, batch, reference=None) -> {"loss", "grad_norm", *METRICS}`` (float32 []);
    ``reference`` is ``dpo_loss``'s (None: the base, LoRA off). ``batch`` maps
    each of ``train.step.BATCH_FIELDS`` to [A, 2P, T]: A micro-batches (``train.step.stack`` of
    ``dpo.data.collate``'s), run one after the other (``lax.scan``). Micro-batches without a pair (padding to
    the step's shape) are not counted. ``loss`` is HF's logged loss (the mean of the micro-batch losses),
    ``grad_norm`` the accumulated gradient's L2 norm before clipping; ``optimizer`` (over
    ``optim.hf_optimizer``'s ``tx``) is updated once.
    """

    @nnx.jit
    def step(model: nnx.Module, optimizer: nnx.Optimizer, batch: Mapping[str, Any],
             reference: nnx.State | None = None) -> dict[str, jax.Array]:
        graphdef, params, rest = nnx.split(model, wrt, ...)

        def micro(carry, micro_batch):
            def value(params):
                return dpo_loss(nnx.merge(graphdef, params, rest, copy=True), micro_batch, loss, reference)

            (value, metrics), grads = jax.value_and_grad(value, has_aux=True)(params)
            # A micro-batch of padding only (a short last step) is skipped, whatever its rows compute.
            used = jnp.asarray(micro_batch["segment_ids"]).any()
            grad_sum, sums, count = carry
            grad_sum = jax.tree.map(lambda s, g: jnp.where(used, s + g, s).astype(s.dtype), grad_sum, grads)
            sums = {k: jnp.where(used, sums[k] + v, sums[k]) for k, v in {"loss": value, **metrics}.items()}
            return (grad_sum, sums, count + used.astype(jnp.float32)), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        init = (zeros, {k: jnp.zeros([], jnp.float32) for k in ("loss", *METRICS)}, jnp.zeros([], jnp.float32))
        (grad_sum, sums, count), _ = jax.lax.scan(micro, init, {k: batch[k] for k in BATCH_FIELDS})
        count = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g: g / count.astype(g.dtype), grad_sum)
        grad_norm = optax.tree.norm(grads)
        optimizer.update(model, grads)
        return {k: v / count for k, v in sums.items()} | {"grad_norm": grad_norm}

    return step
