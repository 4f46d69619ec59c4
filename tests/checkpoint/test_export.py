"""Qwix LoRA on Tunix -> merged HF safetensors and PEFT adapters, and PEFT adapters -> Qwix, checked against
transformers + peft on tiny random Gemma 3 and Gemma 4 (k_eq_v global layers) models."""

import contextlib
import json
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import peft
import pytest
import tiny
import torch
import transformers
from flax import nnx

from gemport.checkpoint import (
    HFCheckpoint,
    export_merged,
    export_peft,
    import_peft,
    load_model,
    load_lora,
    vllm_misserved,
)
from gemport.checkpoint.safetensors import SafetensorsFile, TensorSource, write_file
from gemport.lora import PROJECTIONS, LoraLayout, LoraSpec, apply_lora
from gemport.specs import GemmaSpec
from gemport.check.verify import tunix_logits


def randomize_lora(model, seed=1):
    """Qwix starts B at zero; give A and B random values so that every delta is non-zero."""
    rng = np.random.default_rng(seed)
    flat = [(p, v.replace(jnp.asarray(rng.normal(0, 0.2, v.get_value().shape), v.get_value().dtype)))
            for p, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))]
    nnx.update(model, nnx.from_flat_state(flat))


def hf_deltas(params, spec, lora_spec):
    """``{hf module: B @ A * scale}`` of Qwix LoRA params."""
    return {m: B @ A * lora_spec.scale for t, a, b in LoraLayout(spec, lora_spec).match(params)
            for m, (A, B) in zip(t.hf_modules, t.to_peft(np.asarray(a, np.float64), np.asarray(b, np.float64)))}


def hf_model(directory):
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                              attn_implementation="eager")
    return model.eval()


@pytest.fixture(scope="module", params=["gemma4_dense", "gemma3_1b", "gemma3_qkv", "gemma3_qkv-shared"])
def run(request, tmp_path_factory):
    """A base checkpoint, a Tunix model with random LoRA on every projection, and both exports.

    ``-shared``: Qwix's own fused-module form (one A for q, k and v), as plain-Qwix checkpoints hold it.
    """
    name, _, fused = request.param.partition("-")
    lora_spec = LoraSpec(rank=4, alpha=8.0, fused=fused or "separate")
    root = tmp_path_factory.mktemp(request.param)
    tiny.causal_lm(name).save_pretrained(root / "base")
    spec = GemmaSpec.from_hf(root / "base")
    model = apply_lora(load_model(root / "base"), spec, lora_spec)
    randomize_lora(model)
    ids = tiny.token_ids(spec.vocab)
    export_merged(model, root / "merged", base_dir=root / "base", lora_spec=lora_spec)
    export_peft(model, root / "peft", base_dir=root / "base", lora_spec=lora_spec)
    return SimpleNamespace(root=root, spec=spec, model=model, ids=ids, logits=tunix_logits(model, ids),
                           lora_spec=lora_spec)


def test_family_has_what_the_acceptance_needs(run):
    assert run.spec.family == "gemma3" or any(run.spec.layer_k_eq_v(i) for i in range(run.spec.num_layers))
    params = load_lora(run.model, lora_spec=run.lora_spec).flat()
    assert all(np.abs(v).max() > 0 for v in params.values())


def test_merged_checkpoint_matches_tunix_with_lora(run):
    logits = tiny.hf_logits(hf_model(run.root / "merged"), run.ids)
    np.testing.assert_allclose(logits, run.logits, atol=1e-4, rtol=0)


def test_peft_adapter_matches_tunix_with_lora(run):
    model = peft.PeftModel.from_pretrained(hf_model(run.root / "base"), run.root / "peft").eval()
    np.testing.assert_allclose(tiny.hf_logits(model, run.ids), run.logits, atol=1e-4, rtol=0)
    merged = model.merge_and_unload().state_dict()
    ours = HFCheckpoint(run.root / "merged")
    assert {k for k in merged if k != "lm_head.weight"} <= set(ours.keys())
    for name in ours.keys():
        np.testing.assert_allclose(ours.array(name), merged[name].numpy(), atol=1e-6, rtol=0, err_msg=name)


def test_k_eq_v_layers_carry_k_proj_again_as_v_proj(run):
    """Every layer gets k_proj and v_proj factors; on k_eq_v layers (no v_proj module, V is K) the v_proj copy is
    k_proj's factors bit for bit, for vLLM (see gemport.checkpoint.peft_io)."""
    weights = SafetensorsFile(run.root / "peft/adapter_model.safetensors")
    for i in range(run.spec.num_layers):
        key = f"base_model.model.model.layers.{i}.self_attn.{{}}_proj.lora_{{}}.weight"
        k, v = weights.array(key.format("k", "B")), weights.array(key.format("v", "B"))
        if run.spec.layer_k_eq_v(i):
            np.testing.assert_array_equal(v, k)
            np.testing.assert_array_equal(weights.array(key.format("v", "A")), weights.array(key.format("k", "A")))
        else:
            assert not np.array_equal(v, k)


def test_peft_ignores_the_v_proj_copies(run, tmp_path):
    """PEFT computes bit for bit the same logits with the copies as without them."""
    weights = SafetensorsFile(run.root / "peft/adapter_model.safetensors")
    k_eq_v = [i for i in range(run.spec.num_layers) if run.spec.layer_k_eq_v(i)]
    copies = {key for key in weights.tensors for i in k_eq_v if f".layers.{i}.self_attn.v_proj." in key}
    assert len(copies) == 2 * len(k_eq_v) and bool(copies) == (run.spec.family == "gemma4")
    if not copies:
        return
    (tmp_path / "adapter_config.json").write_bytes((run.root / "peft/adapter_config.json").read_bytes())
    write_file(tmp_path / "adapter_model.safetensors",
               [TensorSource.copy_of(key, info) for key, info in weights.tensors.items() if key not in copies])
    with_copies, without = (peft.PeftModel.from_pretrained(hf_model(run.root / "base"), d).eval()
                            for d in (run.root / "peft", tmp_path))
    np.testing.assert_array_equal(tiny.hf_logits(with_copies, run.ids), tiny.hf_logits(without, run.ids))


def test_import_of_export_reproduces_the_deltas(run):
    lora = import_peft(run.root / "peft", base_dir=run.root / "base")
    assert lora.lora_spec.fused == "separate" and lora.lora_spec.scale == run.lora_spec.scale
    ours = hf_deltas(load_lora(run.model, lora_spec=run.lora_spec).flat(), run.spec, run.lora_spec)
    back = hf_deltas(lora.flat(), run.spec, lora.lora_spec)
    assert ours.keys() == back.keys()
    for m in ours:
        np.testing.assert_allclose(back[m], ours[m], atol=1e-6, rtol=0, err_msg=m)


def test_imported_adapter_runs_in_tunix(run):
    lora = import_peft(run.root / "peft", base_dir=run.root / "base")
    model = apply_lora(load_model(run.root / "base"), run.spec, lora)
    np.testing.assert_allclose(tunix_logits(model, run.ids), run.logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("rslora", [False, True])
def test_gpu_adapter_imports_exactly(run, rslora, tmp_path):
    """An adapter made with peft on the HF model gives the same logits in Tunix after import_peft."""
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=list(PROJECTIONS), use_rslora=rslora)
    model = peft.get_peft_model(hf_model(run.root / "base"), config)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    model.save_pretrained(tmp_path)
    expected = tiny.hf_logits(model.eval(), run.ids)
    lora = import_peft(tmp_path, base_dir=run.root / "base")
    assert lora.lora_spec.rslora == rslora
    tunix = apply_lora(load_model(run.root / "base"), run.spec, lora)
    np.testing.assert_allclose(tunix_logits(tunix, run.ids), expected, atol=1e-4, rtol=0)


def test_reexport_of_an_imported_adapter_is_tensor_for_tensor_identical(run, tmp_path):
    """PEFT -> Qwix -> PEFT keeps every lora_A / lora_B bit for bit (separate factors hold them as they are)."""
    export_peft(import_peft(run.root / "peft", spec=run.spec), tmp_path / "again", base_dir=run.root / "base")
    first, again = (SafetensorsFile(d / "adapter_model.safetensors") for d in (run.root / "peft", tmp_path / "again"))
    assert set(first.tensors) == set(again.tensors)
    for key in first.tensors:
        np.testing.assert_array_equal(again.array(key), first.array(key), err_msg=key)
    model = peft.PeftModel.from_pretrained(hf_model(run.root / "base"), tmp_path / "again").eval()
    np.testing.assert_allclose(tiny.hf_logits(model, run.ids), run.logits, atol=1e-4, rtol=0)


def test_unequal_k_and_v_ranks_import_padded_and_export_exactly(run, tmp_path):
    """rank_pattern giving v_proj a smaller rank than k_proj: zero-padded in kv_einsum, trimmed on export."""
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(PROJECTIONS), rank_pattern={"v_proj": 2},
                             alpha_pattern={"v_proj": 6})
    model = peft.get_peft_model(hf_model(run.root / "base"), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    model.save_pretrained(tmp_path / "gpu")
    expected = tiny.hf_logits(model.eval(), run.ids)
    lora = import_peft(tmp_path / "gpu", spec=run.spec)
    tunix = apply_lora(load_model(run.root / "base"), run.spec, lora)
    np.testing.assert_allclose(tunix_logits(tunix, run.ids), expected, atol=1e-4, rtol=0)
    k_eq_v = [f"model.layers.{i}.self_attn.k_proj" for i in range(run.spec.num_layers) if run.spec.layer_k_eq_v(i)]
    # vLLM would scale a v_proj copy by v_proj's pattern: none is written, and the export says so.
    with pytest.warns(UserWarning, match="different scales") if k_eq_v else contextlib.nullcontext():
        export_peft(lora, tmp_path / "again", spec=run.spec)
    first, again = (SafetensorsFile(tmp_path / d / "adapter_model.safetensors") for d in ("gpu", "again"))
    assert set(again.tensors) == set(first.tensors)
    for key in first.tensors:
        np.testing.assert_array_equal(again.array(key), first.array(key), err_msg=key)
    assert vllm_misserved(tmp_path / "again", spec=run.spec) == k_eq_v
    assert json.loads((tmp_path / "again/adapter_config.json").read_text())["rank_pattern"] == {"v_proj": 2}


def test_exports_of_a_real_scale_checkpoint_agree_within_the_floor(real_checkpoint, tmp_path):
    """Logits at Gemma 4's cap of 30 (`tiny.real_magnitudes`), where the miniatures' fixed 1e-4 above says nothing:
    both exports of a random LoRA on every projection, judged as `gemport verify` judges them, against transformers'
    eager vs sdpa floor measured on the same tokens."""
    from gemport.check.verify import compare_logits

    _, base = real_checkpoint("gemma4_dense")
    spec, lora_spec = GemmaSpec.from_hf(base), LoraSpec(rank=4, alpha=8.0)
    model = apply_lora(load_model(base), spec, lora_spec)
    randomize_lora(model)
    export_merged(model, tmp_path / "merged", base_dir=base, lora_spec=lora_spec)
    export_peft(model, tmp_path / "peft", base_dir=base, lora_spec=lora_spec)
    for report in (compare_logits(tmp_path / "merged", model),
                   compare_logits(base, model, adapter_dir=tmp_path / "peft")):
        assert report.ok and report.max_abs_logit > 20, report
        assert report.floor_name == "transformers eager vs sdpa, float32", report
