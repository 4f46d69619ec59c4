"""One optimizer step as HF's Trainer takes it: token-weighted accumulation, HF's logged loss and grad_norm.

HF's Trainer (transformers 5.12) takes ``gradient_accumulation_steps`` micro-batches per optimizer step,
counts the targets of all of them (``num_items_in_batch``), backpropagates each micro-batch's summed token
loss divided by that count, clips the summed gradient and steps the optimizer. It logs ``loss`` as the sum
of those micro-batch losses (the summed token loss of the whole batch over its targets) and ``grad_norm``
as the gradient's global L2 norm before clipping.
"""

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from gemport.errors import TrainingError
from gemport.step.cross_entropy import next_token_nll, summed_cross_entropy
from gemport.data.batching import BATCH_FIELDS
from gemport.data.packing import tunix_inputs
from gemport.step.attention import check_segments, segment_attention_model
from gemport.step.chunked_loss import hidden_states, target_nll
from gemport.step.remat import tied_remat_model
from gemport.step.scan import scanned_decoder

class StepMetrics(NamedTuple):
    """What ``train_step``'s step returns, each float32 [] or int32 [].

    loss: HF's logged ``loss``: the summed target loss of all micro-batches over their target count.
    grad_norm: HF's logged ``grad_norm``: global L2 norm of the accumulated gradient, before clipping.
    num_tokens: the targets of the whole batch (HF's ``num_items_in_batch``).
    """

    loss: jax.Array
    grad_norm: jax.Array
    num_tokens: jax.Array


def micro_batch_logits(model: nnx.Module, micro_batch: Mapping[str, jax.typing.ArrayLike]) -> jax.Array:
    """Logits [B, T, V] of a Tunix Gemma on one micro-batch of ``BATCH_FIELDS`` [B, T].

    Positions and the block-diagonal causal attention come from ``positions`` and ``segment_ids``
    (``data.tunix_inputs``), so packed, padded and padding-free rows all work.
    """
    inputs = tunix_inputs(**{k: micro_batch[k] for k in BATCH_FIELDS})
    logits, _ = model(inputs["input_tokens"], inputs["positions"], None, inputs["attention_mask"])
    return logits


def tunix_loss(model: nnx.Module, micro_batch: Mapping[str, jax.typing.ArrayLike]) -> tuple[jax.Array, jax.Array]:
    """Summed target loss and target count of a Tunix Gemma on one micro-batch of ``BATCH_FIELDS`` [B, T]
    (`micro_batch_logits`). Returns (float32 [], int32 [])."""
    logits = micro_batch_logits(model, micro_batch)
    return summed_cross_entropy(logits, micro_batch["tokens"], micro_batch["loss_mask"])


def micro_batch_nll(model: nnx.Module, micro_batch: Mapping[str, jax.typing.ArrayLike]) -> jax.Array:
    """Per-target losses float32 [B, T - 1] of a Tunix Gemma on one micro-batch of ``BATCH_FIELDS`` [B, T],
    the fast way: attention from ``segment_ids`` (``attention.segment_attention_model``: blockwise, splash on
    TPU; no [T, S] scores), decoder remat that recomputes one layer at a time, as a scan over blocks of layers
    (``scan.scanned_decoder``; ``remat.tied_remat_model`` where the scan does not apply), and
    the cross-entropy in chunks of tokens (``chunked_loss``: never [B, T, V] logits).
    Position t's loss of token t + 1, equal to ``step.cross_entropy``' on ``micro_batch_logits``.
    """
    tokens = jnp.asarray(micro_batch["tokens"], jnp.int32)
    segment_ids = jnp.asarray(micro_batch["segment_ids"], jnp.int32)
    positions = jnp.asarray(micro_batch["positions"], jnp.int32)
    hidden = hidden_states(scanned_decoder(tied_remat_model(segment_attention_model(model))), tokens, positions,
                           segment_ids)
    return target_nll(model, hidden, tokens)


def segment_loss(model: nnx.Module, micro_batch: Mapping[str, jax.typing.ArrayLike]) -> tuple[jax.Array, jax.Array]:
    """``tunix_loss``'s summed target loss and target count, computed by ``micro_batch_nll`` (segment attention,
    chunked cross-entropy). Returns (float32 [], int32 [])."""
    targets = jnp.asarray(micro_batch["loss_mask"], bool)[:, 1:]
    nll = micro_batch_nll(model, micro_batch)
    return jnp.where(targets, nll, 0.0).sum(), targets.sum(dtype=jnp.int32)


LossFn = Callable[[nnx.Module, Mapping[str, jax.Array]], tuple[jax.Array, jax.Array]]
"""``(model, micro_batch) -> (summed loss float32 [], target count int32 [])``, as ``tunix_loss``."""


def tunix_nll(model: nnx.Module, micro_batch: Mapping[str, jax.typing.ArrayLike]) -> jax.Array:
    """Per-target losses float32 [B, T - 1] of ``tunix_loss`` (Tunix's own attention and logits), as
    ``micro_batch_nll``'s."""
    return next_token_nll(micro_batch_logits(model, micro_batch), micro_batch["tokens"])


def per_target(loss_fn: LossFn) -> Callable[[nnx.Module, Mapping[str, jax.Array]], jax.Array]:
    """The per-target losses [B, T - 1] a step's loss sums: ``micro_batch_nll`` for ``segment_loss``,
    ``tunix_nll`` for ``tunix_loss`` (what ``HFPeftTrainer`` scopes: masked and full-sequence).

    Raises TrainingError for any other loss function."""
    known = {segment_loss: micro_batch_nll, tunix_loss: tunix_nll}
    if loss_fn not in known:
        raise TrainingError(f"{getattr(loss_fn, '__name__', loss_fn)!r}: the trainer logs per-target loss scopes "
                            "of step.segment_loss or step.tunix_loss; give one of them")
    return known[loss_fn]


def train_step(*, wrt: Any = nnx.LoRAParam, loss_fn: LossFn = segment_loss,
               seed: int = 0) -> Callable[[nnx.Module, nnx.Optimizer, Mapping[str, Any]], StepMetrics]:
    """An HF-Trainer optimizer step for an nnx model, jit-compiled once per batch shape.

    Args:
      wrt: what is trained, an nnx filter: ``nnx.LoRAParam`` (LoRA only, as PEFT) or ``nnx.Param`` (every
        parameter); the same filter as the ``nnx.Optimizer``'s ``wrt``.
      loss_fn: ``(model, micro_batch) -> (summed loss float32 [], target count int32 [])``. ``segment_loss`` by
        default (segment attention, chunked cross-entropy: the same loss and gradients without [T, S] scores
        or [B, T, V] logits); ``tunix_loss`` runs Tunix's own attention and logits. With any other than
        ``segment_loss``, a model whose attention ignores segments (Tunix's ``use_flash_attention``) is refused
        packed rows (``BatchError``).
      seed: the LoRA dropout stream's (HF's ``seed``); with a ``model.lora_spec.dropout`` above 0, micro-batch
        ``a`` of the optimizer's step ``n`` trains under ``lora.lora_dropout(model, lora.dropout_key(seed,
        n * A + a))``, the masks ``HFPeftTrainer`` draws for it, and a resumed run (whose optimizer state has
        ``n``) draws them again.

    Returns:
      ``step(model, optimizer, batch) -> StepMetrics`` (loss float32 [], grad_norm float32 [], num_tokens
      int32 []), which updates ``model`` and ``optimizer`` in place. ``batch`` maps each of ``BATCH_FIELDS`` to
      an array [A, B, T] (tokens int32, loss_mask bool, segment_ids int32, positions int32; ``stack`` builds it):
      the A micro-batches of one optimizer step, whose summed gradient, divided by the batch's target count,
      updates ``optimizer`` (an ``nnx.Optimizer`` over ``optim.hf_optimizer``'s ``tx``) once. Empty micro-batches
      and rows contribute nothing. See docs/train.md#one-step-as-hf-takes-it.
    """

    from gemport.lora import dropout_key, lora_dropout  # loads Qwix

    @nnx.jit
    def jitted(model: nnx.Module, optimizer: nnx.Optimizer, batch: Mapping[str, Any]) -> StepMetrics:
        graphdef, params, rest = nnx.split(model, wrt, ...)
        accumulation = batch["tokens"].shape[0]
        first = optimizer.step[...].astype(jnp.int32) * accumulation

        def micro(carry, xs):
            index, micro_batch = xs

            def summed(params):
                micro_model = nnx.merge(graphdef, params, rest, copy=True)
                with lora_dropout(micro_model, dropout_key(seed, first + index)):
                    return loss_fn(micro_model, micro_batch)

            (loss, count), grads = jax.value_and_grad(summed, has_aux=True)(params)
            grad_sum, loss_sum, count_sum = carry
            grad_sum = jax.tree.map(lambda s, g: (s + g).astype(s.dtype), grad_sum, grads)
            return (grad_sum, loss_sum + loss, count_sum + count), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        init = (zeros, jnp.zeros([], jnp.float32), jnp.zeros([], jnp.int32))
        xs = (jnp.arange(accumulation, dtype=jnp.int32), {k: batch[k] for k in BATCH_FIELDS})
        (grad_sum, loss_sum, count), _ = jax.lax.scan(micro, init, xs)
        denominator = jnp.maximum(count, 1)
        grads = jax.tree.map(lambda g: g / denominator.astype(g.dtype), grad_sum)
        grad_norm = optax.tree.norm(grads)
        optimizer.update(model, grads)
        return StepMetrics(loss_sum / denominator, grad_norm, count)

    def step(model: nnx.Module, optimizer: nnx.Optimizer, batch: Mapping[str, Any]) -> StepMetrics:
        if loss_fn is not segment_loss:
            check_segments(model, batch["segment_ids"], "train_step")
        return jitted(model, optimizer, batch)

    return step
