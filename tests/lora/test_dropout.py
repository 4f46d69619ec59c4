"""LoRA dropout as PEFT applies it: on the LoRA branch's input, in training steps only, from a seeded key.

PEFT computes ``lora_B(lora_A(dropout(x)))`` with a ``torch.nn.Dropout(p)`` per adapted module (one
Bernoulli keep mask per element, kept values scaled by 1 / (1 - p)) in train mode, and nothing in eval mode.
Masks are random, so the comparison is in distribution: the masks gemport draws are recorded and checked
against that rule (rate, scaling, one independent mask per projection, fused kv included), and the expected
LoRA gradient over many masks is PEFT's within a bound stated in the test. Exact equality at p = 0 is
tests/lora/test_peft_training.py's; exact resume at p > 0 is tests/run/test_resume.py's.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
from flax import nnx

from gemport.data import pack

from gemport.step import tunix_loss
from gemport.checkpoint import import_peft, load_model
from gemport.lora import PROJECTIONS, LoraLayout, LoraParams, LoraSpec, apply_lora, dropout_key, lora_dropout
from gemport.specs import GemmaSpec
from peft_training import batch, jax_loss, peft_grads, peft_model, torch_loss

P = 0.05  # TRL's ModelConfig default
NAME = "gemma3_1b"  # q_einsum, o, MLP through Qwix's own LoRA; k_proj and v_proj in one fused kv_einsum


def micro_batch(vocab):
    rng = np.random.default_rng(0)
    tokens = [rng.integers(1, vocab, int(n)).astype(np.int32) for n in (9, 7, 11, 5)]
    rows = pack([(t, np.arange(len(t)) >= 2) for t in tokens], 16)
    return {k: v[:2] for k, v in rows.items()}


@pytest.fixture(scope="module")
def model(hf_checkpoint):
    _, path = hf_checkpoint(NAME)
    spec = GemmaSpec.from_hf(path)
    lora_spec = LoraSpec(4, 8.0, PROJECTIONS, dropout=P)
    return spec, apply_lora(load_model(path, param_dtype=jnp.float32), spec, lora_spec, seed=3)


_CALLS = []  # one list for every trace: `forward` compiles once and its callbacks append here


def recorded_dropouts(model, mb, key, monkeypatch):
    """(input, output) of every dropout the model runs in one forward pass, in call order."""
    call = nnx.Dropout.__call__

    def recording(self, inputs, **kwargs):
        out = call(self, inputs, **kwargs)
        jax.debug.callback(lambda i, o: _CALLS.append((np.asarray(i), np.asarray(o))), inputs, out)
        return out

    monkeypatch.setattr(nnx.Dropout, "__call__", recording)
    _CALLS.clear()
    forward(model, mb, key)
    jax.effects_barrier()
    return list(_CALLS)


@nnx.jit
def forward(model, mb, key):
    if key is None:
        return tunix_loss(model, mb)
    with lora_dropout(model, key):
        return tunix_loss(model, mb)


def test_masks_follow_peft_rule(model, monkeypatch):
    """Every adapted projection's LoRA input is dropped with its own mask, at rate p, kept values scaled by
    1 / (1 - p); the same key draws the same masks (a resume redraws them); evaluation draws none.

    Bounds: the dropped count of n independent elements is Binomial(n, p); 6 standard deviations
    (sqrt(p (1 - p) / n) on the rate) are exceeded with probability below 1e-8 (normal approximation, n in
    the thousands). The kv_einsum's k and v masks are independent: both drop an element with probability
    p^2, within the same 6-sigma bound of Binomial(n, p^2)."""
    spec, lora_model = model
    mb = micro_batch(spec.vocab)
    calls = recorded_dropouts(lora_model, mb, dropout_key(7, 0), monkeypatch)
    layout = LoraLayout(spec, lora_model.lora_spec)
    assert len(calls) == len(layout.adapters)  # one dropout per adapted module, none elsewhere
    dropped = total = 0
    for x, y in calls:
        live = x != 0  # an input of 0 reads the same dropped or kept
        kept = (y != 0) & live
        np.testing.assert_allclose(y[kept], x[kept] / (1 - P), rtol=2.5e-7)  # up to float32 rounding
        dropped += int((live & ~kept).sum())
        total += int(live.sum())
    assert abs(dropped / total - P) < 6 * math.sqrt(P * (1 - P) / total), (dropped, total)

    # kv_einsum's input is broadcast to [s = 2 (k, v), B, T, D] before its masks
    fused = [y != 0 for x, y in calls if x.shape[0] == 2 and x.ndim == 4 and np.array_equal(x[0], x[1])]
    assert len(fused) == sum(1 for a in layout.adapters if a.separate)
    both = sum(int((~m[0] & ~m[1]).sum()) for m in fused)
    n = sum(m[0].size for m in fused)
    assert abs(both / n - P**2) < 6 * math.sqrt(P**2 * (1 - P**2) / n), (both, n)
    flat = [(y != 0).ravel() for _, y in calls]
    same_shape = [(i, j) for i in range(len(flat)) for j in range(i) if flat[i].shape == flat[j].shape]
    assert same_shape and all((flat[i] != flat[j]).any() for i, j in same_shape)  # a mask per module

    again = recorded_dropouts(lora_model, mb, dropout_key(7, 0), monkeypatch)
    assert len(again) == len(calls) and all(np.array_equal(a[1], b[1]) for a, b in zip(calls, again))
    other = recorded_dropouts(lora_model, mb, dropout_key(7, 1), monkeypatch)
    assert len(other) == len(calls) and not any(np.array_equal(a[1], b[1]) for a, b in zip(calls, other))
    assert recorded_dropouts(lora_model, mb, None, monkeypatch) == []  # evaluation: PEFT's eval mode


SAMPLES = 128
Z = 5.5


def test_expected_gradient_equals_peft(hf_checkpoint, tmp_path):
    """The LoRA gradient averaged over SAMPLES dropout masks is PEFT's, factor by factor, at p = 0.3.

    Per factor F (lora_A or lora_B of one HF module) each framework's per-mask gradient is projected on
    PEFT's p = 0 gradient of F (a fixed direction d): u = <g, d> / |d|. Under "same distribution", the two
    sample means of u differ by a zero-mean amount whose variance is var_jax / N + var_peft / N (independent
    draws); by the central limit theorem z = (mean_jax - mean_peft) / sqrt(var_jax / N + var_peft / N) is
    standard normal, and |z| > 5.5 has probability 3.8e-8: over the 72 factors, a false failure below 3e-6.
    float32 rounding (1e-6 relative, tests/lora/test_peft_training.py) is far below the standard error.
    The bound has power: the same statistic on the JAX samples scaled by (1 - p), to first order what a
    missing 1 / (1 - p) would give, fails it (|z| about 15). p = 0.3 rather than 0.05 makes dropout's share
    of the gradient large enough for that check with few samples; the rule does not depend on p
    (test_masks_follow_peft_rule).
    """
    p = 0.3
    _, path = hf_checkpoint(NAME)
    spec = GemmaSpec.from_hf(path)
    torch_model = peft_model(path, peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(PROJECTIONS),
                                                   lora_dropout=p))
    torch_model.save_pretrained(tmp_path)
    state, lora_spec = import_peft(tmp_path, spec=spec)
    tokens = batch(spec.vocab, 0)

    def torch_grads():
        torch_model.zero_grad()
        torch_loss(torch_model, tokens).backward()
        return peft_grads(torch_model)

    torch_model.eval()
    direction = torch_grads()  # p = 0: PEFT's eval mode
    torch_model.train()
    torch.manual_seed(0)
    torch_samples = [torch_grads() for _ in range(SAMPLES)]

    lora_spec = dataclasses.replace(lora_spec, dropout=p)
    jax_model = apply_lora(load_model(path, param_dtype=jnp.float32), spec, LoraParams(state, lora_spec))
    graphdef, lora, rest = nnx.split(jax_model, nnx.LoRAParam, ...)

    @jax.jit
    def jax_grads(lora, rest, key):
        def loss(lora):
            m = nnx.merge(graphdef, lora, rest, copy=True)
            with lora_dropout(m, key):
                return jax_loss(m, jnp.asarray(tokens))

        return {".".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(jax.grad(loss)(lora))}

    draws = [jax_grads(lora, rest, dropout_key(11, i)) for i in range(SAMPLES)]
    jax_samples = {k: np.stack([d[k] for d in draws]) for k in draws[0]}
    z, z_unscaled = [], []
    for adapter in LoraLayout(spec, lora_spec):
        names = [f"base_model.model.model.{m}" for m in adapter.hf_modules]
        for factor, jax_name, index in (("lora_A", adapter.lora_a, 0), ("lora_B", adapter.lora_b, 1)):
            pairs = [(direction[f"{n}.lora_A.weight"], direction[f"{n}.lora_B.weight"]) for n in names]
            d = adapter.from_peft(pairs)[index]  # the same direction in Qwix's layout (an exact relayout)
            norm = np.linalg.norm(d)
            u_jax = np.asarray(jax_samples[jax_name]).reshape(SAMPLES, -1) @ d.ravel() / norm
            u_peft = np.array([sum((s[f"{n}.{factor}.weight"] * direction[f"{n}.{factor}.weight"]).sum()
                                   for n in names) for s in torch_samples]) / norm
            se = math.sqrt((u_jax.var(ddof=1) + u_peft.var(ddof=1)) / SAMPLES)
            z.append((u_jax.mean() - u_peft.mean()) / se)
            z_unscaled.append(((1 - p) * u_jax.mean() - u_peft.mean()) / se)
    z, z_unscaled = np.abs(z), np.abs(z_unscaled)
    assert len(z) == 2 * len(LoraLayout(spec, lora_spec).adapters)
    print(f"dropout p={p}: max |z| {z.max():.2f} over {len(z)} factors; unscaled: max |z| {z_unscaled.max():.1f}")
    assert z.max() < Z, z
    assert z_unscaled.max() > Z, z_unscaled
