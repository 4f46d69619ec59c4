"""gemport.step.chunked_loss and the fast step against the full-logits path: per-target losses, both loss scopes
and LoRA gradients from Tunix's logits; train_step's logged loss, grad_norm and trained adapter with the fast
step (segment attention + chunked cross-entropy, the default) against train_step(loss_fn=tunix_loss)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tiny
from flax import nnx
from packed_rows import lora_model, rel_err, rows

from gemport.data import stack

from gemport.step import segment_loss, train_step, tunix_loss
from gemport.data import attention_mask
from gemport.step.cross_entropy import loss_scopes, nll_scopes
from gemport.step.chunked_loss import hidden_states, run_rows, slice_rows, target_nll


@pytest.mark.parametrize("name", ["gemma4_dense", "gemma3_1b"])
def test_chunked_nll_scopes_and_grads_match_full_logits(hf_checkpoint, name):
    model = lora_model(hf_checkpoint, name)
    tokens, positions, segment_ids, loss_mask = rows(tiny.text_config(name).vocab_size)
    mask = attention_mask(segment_ids)
    graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)

    def scopes(lora, chunked):
        m = nnx.merge(graphdef, lora, rest)
        if chunked:  # 7 tokens a chunk: 33 targets in 5 chunks, the last one padded
            return nll_scopes(target_nll(m, hidden_states(m, tokens, positions, mask), tokens, chunk=7), loss_mask,
                              segment_ids)
        return loss_scopes(m(tokens, positions, None, mask)[0], tokens, loss_mask, segment_ids)

    @jax.jit
    def both(lora):  # each path's scopes, and the LoRA gradients of both scopes, in one compile
        out = {}
        for chunked in (False, True):
            grads = {k: jax.grad(lambda lora: scopes(lora, chunked)[k])(lora) for k in ("masked", "full_sequence")}
            out[chunked] = scopes(lora, chunked), grads
        return out

    out = both(lora)
    (ref, ref_grads), (got, got_grads) = out[False], out[True]
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-6)
    for g, r in zip(jax.tree.leaves(got_grads), jax.tree.leaves(ref_grads)):
        assert float(jnp.max(jnp.abs(r))) > 0
        assert rel_err(g, r) < 1e-5
    assert int(ref["masked_targets"]) < int(ref["full_sequence_targets"])


def test_fast_step_trains_as_tunix_step(hf_checkpoint):
    """Three optimizer steps of two micro-batches of the packed rows, from the same adapter."""
    model = lora_model(hf_checkpoint, "gemma4_dense")
    tokens, positions, segment_ids, loss_mask = rows(tiny.text_config("gemma4_dense").vocab_size)
    micro = [dict(tokens=tokens, loss_mask=loss_mask, segment_ids=segment_ids, positions=positions)]
    flipped = {k: v[::-1] for k, v in micro[0].items()}
    batch = stack(micro + [flipped])
    runs = {}
    lr = 1e-3
    for loss_fn in (tunix_loss, segment_loss):
        m = nnx.clone(model)
        optimizer = nnx.Optimizer(m, optax.adamw(lr), wrt=nnx.LoRAParam)
        step = train_step(loss_fn=loss_fn)
        metrics = [jax.device_get(step(m, optimizer, batch)) for _ in range(3)]
        runs[loss_fn.__name__] = metrics, nnx.state(m, nnx.LoRAParam)
    (ref, ref_lora), (got, got_lora) = runs["tunix_loss"], runs["segment_loss"]
    for r, g in zip(ref, got):
        assert int(r.num_tokens) == int(g.num_tokens) > 0
        np.testing.assert_allclose(g.loss, r.loss, rtol=1e-5)
        np.testing.assert_allclose(g.grad_norm, r.grad_norm, rtol=1e-5)
    # Adam moves an element by about lr * sign(g): a gradient near zero can flip sign on float32 noise alone.
    for g, r in zip(jax.tree.leaves(got_lora), jax.tree.leaves(ref_lora)):
        assert float(jnp.max(jnp.abs(g - r))) < 3 * 2 * lr
        assert float(jnp.mean(jnp.abs(g - r))) < 1e-2 * lr


@pytest.mark.parametrize("run, taken", [(1, 1), (3, 3), (5, 6), (512, 12)])
@pytest.mark.parametrize("bits", [True, False], ids=["bit-pattern", "in-place"])
def test_slice_rows_are_the_interleaved_runs_either_way(bits, run, taken):
    """Both ways of slicing a bfloat16 embedding (its bit pattern, for XLA:CPU; in place, for accelerators)
    give runs b, b + s, ... of ``taken`` rows exactly (the least divisor of the slice's 12 rows from ``run``),
    under jit with a traced slice index."""
    w = jax.random.normal(jax.random.key(0), (48, 8)).astype(jnp.bfloat16)
    assert run_rows(48, 4, run) == taken
    rows = jax.jit(lambda b: slice_rows(w, 4, b, run=run, bits=bits))
    for b in range(4):
        want = [start + i for start in range(b * taken, 48, 4 * taken) for i in range(taken)]
        assert len(want) == 12
        np.testing.assert_array_equal(np.asarray(rows(b), np.float32), np.asarray(w[np.array(want)], np.float32))
        assert rows(b).dtype == jnp.bfloat16
