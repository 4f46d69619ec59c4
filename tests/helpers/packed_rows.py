"""Packed rows and a LoRA model to run them through, for the tests that compare one computation of the step with
another (attention, the chunked loss, remat, the step's memory): ``rows`` (examples packed with a sliding window
reaching across their boundaries, padding, an empty row), ``lora_model`` (a tiny model with a non-zero adapter, cut
to two layers), the summed loss and the relative error they are compared by."""

import jax
import jax.numpy as jnp
import numpy as np
import tiny
from flax import nnx

from gemport.checkpoint import load_model
from gemport.lora import LoraSpec, apply_lora
from gemport.specs import GemmaSpec

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
T = tiny.SEQ


def rows(vocab):
    """Row 0 packs examples of 5, 4 and 2 tokens then padding (the window of 4 reaches across each boundary);
    row 1 is one example filling the row; row 2 is empty (all padding)."""
    rng = np.random.default_rng(0)
    segment_ids = np.array([[1] * 5 + [2] * 4 + [3] * 2 + [0], [1] * T, [0] * T], np.int32)
    positions = np.zeros_like(segment_ids)
    for b in range(len(segment_ids)):
        for t in range(1, T):
            same = segment_ids[b, t] == segment_ids[b, t - 1] and segment_ids[b, t] != 0
            positions[b, t] = positions[b, t - 1] + 1 if same else 0
    tokens = np.where(segment_ids > 0, rng.integers(1, vocab, segment_ids.shape), 0).astype(np.int32)
    loss_mask = (segment_ids > 0) & (positions > 1)  # a prompt token per example is not trained
    return tokens, positions, segment_ids, loss_mask


def lora_model(hf_checkpoint, name):
    """The tiny model with LoRA on all seven projections, cut to its last two layers (sliding, then global) to
    keep compiling quick."""
    _, path = hf_checkpoint(name)
    spec = GemmaSpec.from_hf(path)
    assert spec.layer_types[-2:] == ("sliding", "global")
    model = apply_lora(load_model(path), spec, LoraSpec(rank=2, alpha=4, targets=TARGETS))
    model.layers = type(model.layers)(list(model.layers)[-2:])
    key = jax.random.key(1)
    for _, p in nnx.iter_graph(model):  # B starts at zero: give the adapter a non-zero delta
        if isinstance(p, nnx.LoRAParam):
            key, sub = jax.random.split(key)
            p.value = 0.1 * jax.random.normal(sub, p.value.shape, p.value.dtype)
    return model


def summed_loss(logits, tokens, loss_mask):
    log_probs = jax.nn.log_softmax(logits[:, :-1], -1)
    nll = -jnp.take_along_axis(log_probs, tokens[:, 1:, None], -1)[..., 0]
    return jnp.where(loss_mask[:, 1:], nll, 0.0).sum()


def rel_err(a, b):
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
