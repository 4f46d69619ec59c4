"""RoPE at the host's inverse frequencies (``step.rope``): the float64 power rounded once, Tunix's rotation
otherwise, and what the trained step and ``verify`` trace. Tunix computes its timescales in the traced program, which
a TPU's float32 power computes about 80 times less exactly than the CPU (docs/tpu.md, "Precision"). That a DPO
step's policy and reference, two compiled copies of one forward, stay equal to the bit under it is
tests/run/test_dpo_run.py's first step (rewards exactly 0)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gemport.specs import GemmaSpec
from gemport.step import rope
from gemport.step.precision import with_precision

EPS = 2.0**-24
"""float32's unit roundoff."""

GEMMA3 = [dict(head_dim=256, base_frequency=10_000), dict(head_dim=256, base_frequency=1_000_000, scale_factor=8.0),
          dict(head_dim=128, base_frequency=10_000), dict(head_dim=48, base_frequency=10_000)]
GEMMA4 = [dict(head=256, base_frequency=10_000), dict(head=512, base_frequency=1_000_000, rope_proportion=0.25)]


@pytest.mark.parametrize("head_dim, base, proportion, factor", [(256, 10_000, 1.0, 1.0), (256, 1_000_000, 1.0, 8.0),
                                                                (512, 1_000_000, 0.25, 1.0), (48, 10_000, 1.0, 1.0),
                                                                (8, 10_000.0, 0.5, 1.0)])
def test_inv_freq_is_the_float64_power_of_the_float32_exponent_rounded_once(head_dim, base, proportion, factor):
    got = rope.inv_freq(head_dim, base, proportion, factor)
    rotated = int(proportion * head_dim // 2)
    exponent = (2 * np.arange(rotated) / head_dim).astype(np.float32).astype(np.float64)
    assert got.dtype == np.float32 and got.shape == (head_dim // 2,)
    np.testing.assert_array_equal(got[:rotated], np.float32(float(base) ** -exponent / factor))
    assert (got[rotated:] == 0).all()
    torch = pytest.importorskip("torch")  # HF's inv_freq: 1 over torch's float32 power of that exponent, over factor
    hf = (1.0 / base ** (torch.arange(0, 2 * rotated, 2, dtype=torch.int64).float() / head_dim) / factor).numpy()
    np.testing.assert_array_max_ulp(got[:rotated], hf, maxulp=2)


def test_inv_freq_refuses_a_scale_factor_below_one():
    with pytest.raises(ValueError, match="scale_factor"):
        rope.inv_freq(8, 10_000.0, scale_factor=0.5)


def reference(inputs, positions, frequencies):
    """The rotation in float64 at the float32 inverse frequencies' exact values."""
    x = np.asarray(inputs, np.float64)
    angles = (np.asarray(positions, np.float64)[..., None] * frequencies.astype(np.float64))[..., None, :]
    first, second = np.split(x, 2, axis=-1)
    return np.concatenate([first * np.cos(angles) - second * np.sin(angles),
                           second * np.cos(angles) + first * np.sin(angles)], axis=-1)


def batch(head_dim):
    rng = np.random.default_rng(0)
    inputs = jnp.asarray(rng.standard_normal((2, 64, 4, head_dim)), jnp.float32)
    positions = jnp.asarray(np.stack([np.arange(64), 4000 + np.arange(64)]), jnp.int32)  # near 4096 too
    return inputs, positions


def bound(inputs, positions):
    # An angle rounds once to float32 (half an ulp of the largest; its frequency is at most 1) and its frequency
    # once, then sin, cos and the two products and the sum each a few units: |x| times that.
    largest = float(jnp.max(positions))
    return float(jnp.max(jnp.abs(inputs))) * (largest * 2 * EPS + 8 * EPS)


@pytest.mark.parametrize("kwargs", GEMMA3, ids=lambda k: f"{k['head_dim']}-{k['base_frequency']}")
def test_gemma3s_rotation_is_tunixs_at_exact_angles(kwargs):
    from tunix.models.gemma3 import model as g3

    inputs, positions = batch(kwargs["head_dim"])
    want = reference(inputs, positions, rope.inv_freq(kwargs["head_dim"], kwargs["base_frequency"],
                                                      scale_factor=kwargs.get("scale_factor", 1.0)))
    ours = np.asarray(jax.jit(lambda x, p: rope.gemma3_rope(x, p, **kwargs))(inputs, positions), np.float64)
    tunix = np.asarray(jax.jit(lambda x, p: g3.apply_rope(x, p, **kwargs))(inputs, positions), np.float64)
    assert np.abs(ours - want).max() <= bound(inputs, positions)
    assert np.abs(tunix - want).max() <= 2 * bound(inputs, positions)  # the same rotation, its angles as rounded


@pytest.mark.parametrize("kwargs", GEMMA4, ids=lambda k: f"{k['head']}-{k['base_frequency']}")
def test_gemma4s_rotation_is_tunixs_at_exact_angles(kwargs):
    from tunix.models.gemma4 import model as g4

    kwargs = dict(kwargs)
    head = kwargs.pop("head")
    inputs, positions = batch(head)
    want = reference(inputs, positions, rope.inv_freq(head, kwargs["base_frequency"],
                                                      kwargs.get("rope_proportion", 1.0)))
    ours = np.asarray(jax.jit(lambda x, p: rope.gemma4_rope(x, p, **kwargs))(inputs, positions), np.float64)
    tunix = np.asarray(jax.jit(lambda x, p: g4.apply_rope(x, p, **kwargs))(inputs, positions), np.float64)
    assert np.abs(ours - want).max() <= bound(inputs, positions)
    assert np.abs(tunix - want).max() <= 2 * bound(inputs, positions)
    if kwargs.get("rope_proportion", 1.0) < 1:  # the unrotated pairs pass through
        rotated = int(kwargs["rope_proportion"] * head // 2)
        half = head // 2
        for part in (slice(rotated, half), slice(half + rotated, head)):
            np.testing.assert_array_equal(np.asarray(inputs)[..., part], ours[..., part])


def test_exact_rope_puts_its_rotations_in_tunixs_place_while_open():
    from tunix.models.gemma3 import model as g3
    from tunix.models.gemma4 import model as g4

    before = g3.apply_rope, g4.apply_rope
    with rope.exact_rope():
        assert (g3.apply_rope, g4.apply_rope) == (rope.gemma3_rope, rope.gemma4_rope)
        with rope.exact_rope():  # nested: the outer's stay after the inner closes
            pass
        assert (g3.apply_rope, g4.apply_rope) == (rope.gemma3_rope, rope.gemma4_rope)
    assert (g3.apply_rope, g4.apply_rope) == before


@pytest.mark.parametrize("family", ["gemma3-1b", "gemma4-31b"])
@pytest.mark.parametrize("precision", ["default", "highest"])
def test_a_step_traced_with_the_recipes_precision_computes_no_timescale(family, precision):
    """Tunix's forward computes its timescales with ``pow``; traced by ``with_precision`` (the trained step's and
    ``verify``'s way), none: they are constants from the host."""
    full = GemmaSpec.preset(family)
    heads = dict(num_heads=2, num_kv_heads=1, head_dim=16) if family.startswith("gemma3") else dict(
        head_dim=16, global_head_dim=32)  # Gemma 4's global layers keep their own head counts
    spec = dataclasses.replace(full, num_layers=2, layer_types=full.layer_types[4:6], hidden=64, mlp=128, vocab=256,
                               sliding_window=8, **heads)
    model = spec.tunix_model_class()(spec.to_tunix(param_dtype=jnp.float32), rngs=nnx.Rngs(0))
    tokens = jnp.zeros((1, 8), jnp.int32)

    def forward(model):
        return model(tokens, jnp.arange(8)[None], None, jnp.tril(jnp.ones((1, 8, 8), bool)))[0]

    def pows(fn):
        return str(jax.make_jaxpr(fn)(model)).count(" pow ")

    assert pows(forward) > 0
    assert pows(with_precision(forward, precision)) == 0


@pytest.mark.parametrize("name, rotation", [("gemma3_1b", "gemma3_rope"), ("gemma4_dense", "gemma4_rope")])
def test_verify_takes_its_tunix_logits_at_the_hosts_frequencies(hf_checkpoint, monkeypatch, name, rotation):
    from gemport.check.verify import tunix_logits
    from gemport.checkpoint import load_model

    _, path = hf_checkpoint(name)
    model = load_model(path)
    calls = []
    real = getattr(rope, rotation)
    monkeypatch.setattr(rope, rotation, lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
    logits = tunix_logits(model, np.ones((1, 4), np.int32))
    assert calls and np.isfinite(logits).all()
