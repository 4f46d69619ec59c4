"""Token-weighted gradient accumulation equals one step on a single batch holding all the tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from gemport.optim import accumulate_tokens, hf_optimizer

VOCAB, DIM, LENGTH = 11, 6, 16
TOKEN_COUNTS = (3, 16, 9)  # micro-batches of different sizes


def token_losses(params, inputs, targets):
    logits = inputs @ params["proj"]["kernel"] + params["proj"]["bias"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


def summed_loss(params, batch):
    return jnp.sum(token_losses(params, batch["inputs"], batch["targets"]) * batch["mask"])


def mean_loss(params, batch):
    return summed_loss(params, batch) / jnp.sum(batch["mask"])


def micro_batches(seed):
    rng = np.random.default_rng(seed)
    batches = []
    for count in TOKEN_COUNTS:
        mask = np.zeros((1, LENGTH), np.float32)
        mask[0, :count] = 1
        batches.append(
            {
                "inputs": rng.standard_normal((1, LENGTH, DIM)).astype(np.float32),
                "targets": rng.integers(0, VOCAB, (1, LENGTH)),
                "mask": mask,
            }
        )
    return batches


def whole_batch(batches):
    return {key: np.concatenate([b[key] for b in batches]) for key in batches[0]}


@pytest.fixture
def params():
    rng = np.random.default_rng(0)
    return {
        "proj": {
            "kernel": jnp.asarray(rng.standard_normal((DIM, VOCAB)), jnp.float32),
            "bias": jnp.asarray(rng.standard_normal(VOCAB), jnp.float32),
        }
    }


def relative_error(a, b):
    diffs = jax.tree.leaves(jax.tree.map(lambda x, y: jnp.max(jnp.abs(x - y)), a, b))
    return float(max(diffs) / max(jnp.max(jnp.abs(y)) for y in jax.tree.leaves(b)))


def accumulated(tx, params, state, batches):
    """Feeds micro-batches one by one; returns the updates of each call."""
    step = jax.jit(
        lambda grads, state, params, n: tx.update(grads, state, params, num_tokens=n)
    )
    out = []
    for batch in batches:
        grads = jax.grad(summed_loss)(params, batch)
        updates, state = step(grads, state, params, int(batch["mask"].sum()))
        out.append(updates)
    return out, state


def test_accumulated_gradient_is_the_whole_batch_token_mean(params):
    batches = micro_batches(1)
    tx = accumulate_tokens(optax.identity(), len(batches))
    updates, _ = accumulated(tx, params, tx.init(params), batches)
    for held in updates[:-1]:
        assert all(float(jnp.max(jnp.abs(u))) == 0 for u in jax.tree.leaves(held))
    expected = jax.grad(mean_loss)(params, whole_batch(batches))
    assert relative_error(updates[-1], expected) < 1e-6
    # Averaging per-micro-batch means, as optax.MultiSteps does, weighs 3 tokens like 16: not HF's gradient.
    mean_of_means = jax.tree.map(lambda *g: sum(g) / len(g), *[jax.grad(mean_loss)(params, b) for b in batches])
    assert relative_error(mean_of_means, expected) > 0.05


def test_per_micro_batch_accumulation_equals_single_batch_steps(params):
    recipe = dict(
        learning_rate=1e-2,
        weight_decay=0.1,
        warmup_steps=2,
        lr_scheduler_type="cosine",
        max_grad_norm=0.5,
        optim="adamw_torch",
    )
    single = hf_optimizer(recipe, num_training_steps=4).tx
    accumulating = hf_optimizer({**recipe, "gradient_accumulation_steps": len(TOKEN_COUNTS)},
                                 num_training_steps=4).per_micro_batch

    reference, reference_state = params, single.init(params)
    ported, ported_state = params, accumulating.init(params)
    single_step = jax.jit(single.update)
    for seed in range(4):
        batches = micro_batches(seed + 10)
        updates, reference_state = single_step(
            jax.grad(mean_loss)(reference, whole_batch(batches)), reference_state, reference
        )
        reference = optax.apply_updates(reference, updates)
        step_updates, ported_state = accumulated(accumulating, ported, ported_state, batches)
        for update in step_updates:
            ported = optax.apply_updates(ported, update)
        assert relative_error(ported, reference) < 1e-6
    assert relative_error(params, reference) > 1e-3


def test_state_keeps_the_parameters_dtype_under_scan():
    params = {"w": jnp.ones(4, jnp.bfloat16)}
    tx = accumulate_tokens(optax.sgd(0.1), 2)

    def step(state, grads):
        _, state = tx.update(grads, state, params, num_tokens=2)
        return state, None

    state, _ = jax.lax.scan(step, tx.init(params), {"w": jnp.ones((3, 4), jnp.float32)})
    assert state.grad_sum["w"].dtype == jnp.bfloat16


def test_num_tokens_is_required(params):
    tx = hf_optimizer({"gradient_accumulation_steps": 2}, num_training_steps=4).per_micro_batch
    with pytest.raises(TypeError, match="num_tokens"):
        tx.update(params, tx.init(params), params)
