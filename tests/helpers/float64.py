"""float64 on both sides, for comparisons that must not see float32 rounding.

transformers' Gemma modules compute RMSNorm, RoPE tables and the eager softmax in float32 whatever the model's
dtype (``x.float()``, ``dtype=torch.float32``), and Tunix's Gemma 4 casts norms, RoPE, softmax, router and logits
to ``jnp.float32``. A model in float64 thus still rounds to float32 at those steps, and two correct
implementations then differ by float32 noise (~1e-5 relative on a gradient), which depends on the machine's
float32 kernels. Inside these contexts every float32 request means float64, and each context records what
would still come out in float32, so a test can assert the whole computation ran in float64.
"""

from __future__ import annotations

import contextlib
import importlib

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
import torch

from gemport._src.torch_float64 import TorchFloat64  # noqa: F401  (the tests' name for it)

# Tunix (and gemport's Tunix MoE) modules whose functions cast to jnp.float32 explicitly (Gemma 3's follow the input dtype).
TUNIX_FLOAT32_MODULES = ("tunix.models.gemma4.model", "tunix.models.gemma4.moe", "gemport._src.moe")


class _Float64Numpy:
    """``jax.numpy`` with ``float32`` meaning ``float64``."""

    def __getattr__(self, name):
        return jnp.float64 if name == "float32" else getattr(jnp, name)


@contextlib.contextmanager
def tunix_float64(monkeypatch, also=()):
    """x64 on, and Tunix's explicit float32 casts widened to float64, and those of the modules named in ``also``
    (undone with ``monkeypatch``)."""
    for name in (*TUNIX_FLOAT32_MODULES, *also):
        monkeypatch.setattr(importlib.import_module(name), "jnp", _Float64Numpy())
    with jax.enable_x64(True):
        yield


def jax_float32_values(fn, *args):
    """The primitives of ``fn(*args)``'s jaxpr (sub-jaxprs included) with a float32 input or output."""
    found = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if any(getattr(v.aval, "dtype", None) == np.float32 for v in (*eqn.invars, *eqn.outvars)):
                found.add(eqn.primitive.name)
            for sub in jex.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def torch_logits(model_class, path, ids):
    """float64 logits [B, T, V] of the transformers model saved in ``path`` on token ids [B, T], with no float32
    step (the model is built inside ``TorchFloat64``, so its RoPE tables and embedding scale are float64 too)."""
    with TorchFloat64() as mode:
        # torch's grouped matmul, transformers' default for MoE experts, has no float64 kernel.
        model = model_class.from_pretrained(path, dtype=torch.float64, attn_implementation="eager",
                                            experts_implementation="eager")
        mode.float32_results.clear()
        with torch.no_grad():
            logits = model(torch.as_tensor(ids, dtype=torch.long)).logits
    assert not mode.float32_results, mode.float32_results
    return logits.numpy()


def assert_float32_close(got, float32_peer, exact, factor=10):
    """``got`` (float32) is within ``factor`` times the distance of a correct float32 implementation
    (``float32_peer``, computed alongside) from the exact float64 result: max-abs over ``exact``'s max-abs."""
    scale = np.abs(exact).max()
    floor = np.abs(np.asarray(float32_peer, np.float64) - exact).max() / scale
    error = np.abs(np.asarray(got, np.float64) - exact).max() / scale
    assert 0 < floor < 1e-3, floor  # the peer is float32, and close
    assert error <= factor * floor, f"{error:.2e} > {factor} x the float32 floor {floor:.2e}"
    print(f"float32 error {error:.1e}: {error / (factor * floor):.2f} of the bound {factor * floor:.1e}")


def relative(got, want):
    return abs(float(got) - float(want)) / abs(float(want))


def trajectory_bound(float32_runs, exact, quantity, steps=slice(None)):
    """10x the largest relative distance of ``quantity`` in the logs of correct float32 training runs (lists of
    per-step dicts) from the float64 run's ``exact``, over ``steps``.

    Adam's first updates are lr * sign(g): elements with near-zero gradients move on float32 noise, and the steps
    that follow amplify it, by an amount that depends on the float32 kernels (1e-4 in grad_norm after a few steps
    on a tiny model, in any two implementations). One run on one step is a single draw of that noise: the largest
    over the runs and steps, times 10.
    """
    floor = max(relative(run[i][quantity], want[quantity])
                for run in float32_runs for i, want in list(enumerate(exact))[steps])
    assert 0 < floor < 1e-3, (quantity, floor)  # the float32 runs are noisy, and only noisy
    return 10 * floor
