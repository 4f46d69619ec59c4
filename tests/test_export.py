"""Qwix LoRA on Tunix -> merged HF safetensors and PEFT adapters, and PEFT adapters -> Qwix, checked against
transformers + peft on tiny random Gemma 3 and Gemma 4 (k_eq_v global layers) models."""

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

from gemport.checkpoint import HFCheckpoint, export_merged, export_peft, import_peft, load_tunix_model, lora_params
from gemport.checkpoint.adapters import match
from gemport.checkpoint.safetensors import SafetensorsFile
from gemport.lora import PROJECTIONS, LoraSpec, apply_lora
from gemport.specs import GemmaSpec
from gemport.verify import tunix_logits

LORA = LoraSpec(rank=4, alpha=8.0)


def randomize_lora(model, seed=1):
    """Qwix starts B at zero; give A and B random values so that every delta is non-zero."""
    rng = np.random.default_rng(seed)
    flat = [(p, v.replace(jnp.asarray(rng.normal(0, 0.2, v.get_value().shape), v.get_value().dtype)))
            for p, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))]
    nnx.update(model, nnx.from_flat_state(flat))


def hf_deltas(params, spec, lora_spec):
    """``{hf module: B @ A * scale}`` of Qwix LoRA params."""
    return {m: B @ A * lora_spec.scale for t, a, b in match(params, spec, lora_spec)
            for m, (A, B) in zip(t.hf_modules, t.to_peft(np.asarray(a, np.float64), np.asarray(b, np.float64)))}


def hf_model(directory):
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                              attn_implementation="eager")
    return model.eval()


@pytest.fixture(scope="module", params=["gemma4_dense", "gemma3_1b", "gemma3_qkv"])
def run(request, tmp_path_factory):
    """A base checkpoint, a Tunix model with random Qwix LoRA on every projection, and both exports."""
    root = tmp_path_factory.mktemp(request.param)
    tiny.causal_lm(request.param).save_pretrained(root / "base")
    spec = GemmaSpec.from_hf(root / "base")
    model = apply_lora(load_tunix_model(root / "base"), spec, LORA)
    randomize_lora(model)
    ids = tiny.token_ids(spec.vocab)
    export_merged(root / "base", model, root / "merged", lora_spec=LORA)
    export_peft(model, root / "peft", spec=spec, lora_spec=LORA, base_model_name_or_path=str(root / "base"))
    return SimpleNamespace(root=root, spec=spec, model=model, ids=ids, logits=tunix_logits(model, ids))


def test_family_has_what_the_acceptance_needs(run):
    assert run.spec.family == "gemma3" or any(run.spec.layer_k_eq_v(i) for i in range(run.spec.num_layers))
    params = lora_params(run.model)
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


def test_gemma4_k_eq_v_layers_get_k_proj_only(run):
    keys = set(SafetensorsFile(run.root / "peft/adapter_model.safetensors").tensors)
    for i in range(run.spec.num_layers):
        has_v = f"base_model.model.model.layers.{i}.self_attn.v_proj.lora_A.weight" in keys
        assert f"base_model.model.model.layers.{i}.self_attn.k_proj.lora_A.weight" in keys
        assert has_v != run.spec.layer_k_eq_v(i)


def test_import_of_export_reproduces_the_deltas(run):
    lora_spec, state = import_peft(run.root / "peft", run.spec)
    assert lora_spec.fused == "stacked" and lora_spec.scale == LORA.scale
    ours = hf_deltas(lora_params(run.model), run.spec, LORA)
    back = hf_deltas(lora_params(state), run.spec, lora_spec)
    assert ours.keys() == back.keys()
    for m in ours:
        np.testing.assert_allclose(back[m], ours[m], atol=1e-6, rtol=0, err_msg=m)


def test_imported_adapter_runs_in_tunix(run):
    lora_spec, state = import_peft(run.root / "peft", run.spec)
    model = apply_lora(load_tunix_model(run.root / "base"), run.spec, lora_spec, state)
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
    lora_spec, state = import_peft(tmp_path, run.spec)
    assert lora_spec.rslora == rslora
    tunix = apply_lora(load_tunix_model(run.root / "base"), run.spec, lora_spec, state)
    np.testing.assert_allclose(tunix_logits(tunix, run.ids), expected, atol=1e-4, rtol=0)


def test_stacked_adapter_exports_with_rank_pattern(run, tmp_path):
    """Re-exporting an imported adapter keeps the 2r (3r) fused modules exact via rank_pattern/alpha_pattern."""
    lora_spec, state = import_peft(run.root / "peft", run.spec)
    export_peft(state, tmp_path / "again", spec=run.spec, lora_spec=lora_spec)
    config = json.loads((tmp_path / "again/adapter_config.json").read_text())
    fused = [m for m, r in config["rank_pattern"].items() if r != config["r"]]
    assert fused and all(m.endswith(("q_proj", "k_proj", "v_proj")) for m in fused)
    model = peft.PeftModel.from_pretrained(hf_model(run.root / "base"), tmp_path / "again").eval()
    np.testing.assert_allclose(tiny.hf_logits(model, run.ids), run.logits, atol=1e-4, rtol=0)
