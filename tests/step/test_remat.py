"""Decoder remat that recomputes one layer at a time (``step.remat``) against Tunix's ``nnx.remat``.

The fast step rematerialises each decoder layer after its output's cotangent exists; the values and LoRA
gradients are those of Tunix's own decoder remat and of no remat at all, and a compile for a TPU slice shows
the memory it saves.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
import tiny
from flax import nnx
from packed_rows import lora_model, rel_err, rows

from gemport.lora import LoraSpec
from gemport.mesh import make_mesh, slice_devices
from gemport.plan.compiled import compile_step, step_trainer
from gemport.specs import GemmaSpec
from gemport.step import segment_loss
from gemport.step import remat as remat_lib
from gemport.step.remat import set_remat


def _loss_and_grads(model, batch):
    # nnx's transforms, as HFPeftTrainer's step differentiates (Tunix's nnx.remat on Gemma 3 mutates its params'
    # trace state, which jax.value_and_grad over split params does not allow)
    def loss(model):
        return segment_loss(model, batch)[0]

    loss, grads = nnx.jit(lambda m: nnx.value_and_grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(m))(model)
    return loss, [v.get_value() for _, v in nnx.to_flat_state(grads)]


@pytest.mark.parametrize("name", ["gemma4_dense", "gemma3_1b"])
def test_the_fast_steps_remat_gives_tunixs_loss_and_lora_grads(hf_checkpoint, name, monkeypatch):
    """Summed loss and LoRA gradients of ``segment_loss`` under decoder remat (what ``gradient_checkpointing: true``
    sets: on a decoder of one block, as here, on Gemma 4 the layers' recomputation tied to their cotangents, on
    Gemma 3 Tunix's ``nnx.remat``; tests/step/test_scan.py holds the scan of longer decoders) against the same step
    without remat (``false``) and, on Gemma 4, under Tunix's ``nnx.remat``: within 1e-5 relative (float32; the
    arithmetic is the same, fused differently)."""
    family = GemmaSpec.from_hf(hf_checkpoint(name)[1]).family
    model = lora_model(hf_checkpoint, name)
    tokens, positions, segment_ids, loss_mask = rows(tiny.text_config(name).vocab_size)
    batch = dict(tokens=tokens, positions=positions, segment_ids=segment_ids, loss_mask=loss_mask)
    results = {}
    for remat in ("none", "decoder"):
        set_remat(model, remat)
        results[remat] = _loss_and_grads(model, batch)
    if family == "gemma4":
        with monkeypatch.context() as m:  # Tunix's own decoder remat
            m.setattr("gemport.step.hf.tied_remat_model", lambda model: model)
            results["tunix"] = _loss_and_grads(model, batch)
    (loss, grads) = results.pop("decoder")
    assert any(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))
    for other_loss, other_grads in results.values():
        assert rel_err(loss, other_loss) < 1e-5
        for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(other_grads)):
            assert rel_err(g, r) < 1e-5


def test_the_model_is_left_as_it_was(hf_checkpoint):
    model = lora_model(hf_checkpoint, "gemma4_dense")
    before = [type(m) for _, m in nnx.iter_modules(model)]
    copy = remat_lib.tied_remat_model(model)
    assert [type(m) for _, m in nnx.iter_modules(model)] == before
    assert any(type(m).__name__ == "TiedDecoderLayer" for _, m in nnx.iter_modules(copy))


def test_one_layers_backward_is_live_at_a_time_on_a_tpu_slice(monkeypatch):
    """Compiled for a v5p-8 (fsdp=4, one row of 512 tokens per chip, decoder remat, 6 layers): under Tunix's
    ``nnx.remat`` TPU's scheduler keeps two [T, F] MLP products of every layer until the end of the backward
    pass; with each layer's backward pass bracketed (unrolled), or the layers scanned (one block's backward pass
    at a time), the step's temporaries are smaller."""
    from gemport.specs import GemmaSpec

    spec = GemmaSpec.from_hf(tiny.text_config("gemma4_mesh").to_dict())
    spec = dataclasses.replace(spec, hidden=256, mlp=4096, num_layers=6, layer_types=("sliding", "global") * 3)
    mesh = make_mesh(spec, fsdp=4, tp=1, devices=slice_devices("v5p-8"))
    peaks = {}
    for name, replaced in (("scanned", ()), ("tied", ("scanned_decoder",)),
                           ("tunix", ("scanned_decoder", "tied_remat_model"))):
        from gemport.run.model import lora_model as abstract_lora_model

        model = abstract_lora_model(spec, LoraSpec(4, 8.0), remat="decoder", param_dtype=jnp.bfloat16)
        with monkeypatch.context() as m:
            for function in replaced:  # the unrolled decoder, with or without each layer's backward bracketed
                m.setattr(f"gemport.step.hf.{function}", lambda model: model)
            peaks[name] = compile_step(step_trainer(model), mesh, 4, 512).temp_bytes
    print(peaks)
    assert peaks["tied"] < peaks["tunix"] and peaks["scanned"] < peaks["tunix"], peaks
