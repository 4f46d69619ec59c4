"""clip_grad_norm against torch.nn.utils.clip_grad_norm_, where optax.clip_by_global_norm differs."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from gemport.optim import clip_grad_norm

SHAPES = {"a": (3, 4), "b": (5,), "c": (2, 2, 2)}


def gradients(norm):
    rng = np.random.default_rng(1)
    raw = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}
    total = np.sqrt(sum((g.astype(np.float64) ** 2).sum() for g in raw.values()))
    return {name: (g * (norm / total)).astype(np.float32) for name, g in raw.items()}


def torch_clip(grads, max_norm):
    params = {name: torch.zeros(g.shape, requires_grad=True) for name, g in grads.items()}
    for name, p in params.items():
        p.grad = torch.from_numpy(grads[name].copy())
    torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm)
    return {name: p.grad.numpy() for name, p in params.items()}


def apply(tx, grads):
    tree = {name: jnp.asarray(g) for name, g in grads.items()}
    updates, _ = tx.update(tree, tx.init(tree))
    return {name: np.asarray(u) for name, u in updates.items()}


def max_relative(a, b):
    return max(np.abs(a[n] - b[n]).max() / np.abs(b[n]).max() for n in b)


@pytest.mark.parametrize(
    "norm, max_norm",
    [(1e-5, 1e-5), (3e-6, 1e-5), (1e-3, 1e-4), (0.5, 1.0), (1.0, 1.0), (3.0, 1.0), (100.0, 1.0)],
)
def test_matches_torch_clip_grad_norm(norm, max_norm):
    grads = gradients(norm)
    assert max_relative(apply(clip_grad_norm(max_norm), grads), torch_clip(grads, max_norm)) < 1e-6


@pytest.mark.parametrize("norm, max_norm", [(1e-5, 1e-5), (2e-5, 1e-5)])
def test_optax_clip_by_global_norm_misses_torchs_epsilon(norm, max_norm):
    """At small norms torch's +1e-6 matters: it scales by 0.909 and 0.476 where Optax scales by 1 and 0.5."""
    grads = gradients(norm)
    assert max_relative(apply(optax.clip_by_global_norm(max_norm), grads), torch_clip(grads, max_norm)) > 0.04


def test_keeps_dtype():
    grads = {"a": jnp.full((4,), 10.0, jnp.bfloat16)}
    updates, _ = clip_grad_norm(1.0).update(grads, clip_grad_norm(1.0).init(grads))
    assert updates["a"].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(updates["a"], np.float32), 0.5, rtol=1e-2)
