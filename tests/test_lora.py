"""LoraSpec: PEFT <-> Qwix configs, and which Tunix modules PEFT targets mean."""

import dataclasses
import math
import re

import numpy as np
import peft
import pytest
import tiny

from gemport.errors import LoraError
from gemport.lora import PROJECTIONS, LoraSpec, targets
from gemport.specs import GemmaSpec


def spec_of(name):
    cfg = tiny.text_config(name).to_dict()
    return GemmaSpec.from_hf(cfg)


def modules(spec, lora_spec):
    """Tunix module paths that the Qwix provider's rules match, among all Tunix weights of the model."""
    from gemport import names

    rules = lora_spec.to_qwix(spec)._rules
    every = {e.module.replace(".", "/") for e in names.entries(spec)}
    return {m for m in every if any(re.fullmatch(r.module_path, m) for r in rules)}


def test_from_peft_round_trip():
    config = peft.LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj", "k_proj"], lora_dropout=0.05,
                             use_rslora=True)
    spec = LoraSpec.from_peft(config)
    assert spec == LoraSpec(16, 32.0, ("q_proj", "k_proj", "v_proj"), rslora=True, dropout=0.05)
    assert LoraSpec.from_peft(spec.to_peft("google/gemma-4-31b")) == spec
    rebuilt = peft.LoraConfig(**{k: v for k, v in spec.to_peft().items() if k != "peft_type"})
    assert LoraSpec.from_peft(rebuilt) == spec
    assert LoraSpec.from_json(spec.to_json()) == spec


def test_from_peft_all_linear_and_directory(tmp_path):
    (tmp_path / "adapter_config.json").write_text(
        '{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": "all-linear"}')
    assert LoraSpec.from_peft(tmp_path).targets == PROJECTIONS


@pytest.mark.parametrize("bad, why", [
    (dict(use_dora=True), "DoRA"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(bias="all"), "bias"),
    (dict(target_modules=r".*q_proj"), "regex"),
    (dict(rank_pattern={"q_proj": 4}), "import_peft"),
    (dict(target_modules=["q_proj", "fc1"]), "fc1"),
])
def test_from_peft_refuses_what_qwix_cannot_do(bad, why):
    config = dict(LoraSpec(8, 16.0).to_peft(), **bad)
    with pytest.raises(LoraError, match=why):
        LoraSpec.from_peft(config)


def test_rslora_maps_to_the_same_scale_in_qwix():
    spec = LoraSpec(16, 8.0, rslora=True)
    (rule,) = spec.to_qwix(spec_of("gemma3_1b"))._rules
    assert rule.alpha / rule.rank == pytest.approx(8.0 / math.sqrt(16)) == spec.scale


def test_gemma4_k_and_v_reach_kv_einsum_on_sliding_and_k_einsum_on_global_layers():
    spec = spec_of("gemma4_dense")
    hit = modules(spec, LoraSpec(4, 8.0, ("k_proj", "v_proj")))
    sliding, global_ = spec.layers_of("sliding"), spec.layers_of("global")
    assert global_ and sliding
    assert hit == {f"layers/{i}/attn/kv_einsum" for i in sliding} | {f"layers/{i}/attn/k_einsum" for i in global_}


def test_all_projections_hit_exactly_the_projection_modules():
    spec = spec_of("gemma4_dense")
    hit = modules(spec, LoraSpec(4, 8.0))
    kinds = {m.split("/", 2)[2] for m in hit}
    assert kinds == {"attn/q_einsum", "attn/kv_einsum", "attn/k_einsum", "attn/attn_vec_einsum",
                     "mlp/gate_proj", "mlp/up_proj", "mlp/down_proj"}
    assert len(hit) == 6 * spec.num_layers  # q, kv or k, o, gate, up, down
    rules = LoraSpec(4, 8.0).to_qwix(spec)._rules
    assert not any(re.fullmatch(r.module_path, "vision_encoder/layers/0/attn/q_einsum") for r in rules)


def test_kv_shared_layers_get_no_kv_lora():
    spec = spec_of("gemma4_ple")
    hit = modules(spec, LoraSpec(4, 8.0, ("k_proj", "v_proj")))
    assert hit and not any(int(m.split("/")[1]) >= spec.num_layers - spec.num_kv_shared_layers for m in hit)


@pytest.mark.parametrize("name, partial, module", [
    ("gemma4_dense", ("q_proj", "k_proj"), "kv_einsum"),
    ("gemma3_qkv", ("q_proj", "k_proj", "v_proj", "o_proj")[:2], "qkv_einsum"),
])
def test_partial_fused_targets_are_refused(name, partial, module):
    with pytest.raises(LoraError, match=f"{module}.*add .*v_proj"):
        targets(spec_of(name), partial)


@pytest.mark.parametrize("name", ["gemma4_dense", "gemma3_qkv"])
def test_peft_layout_round_trips_through_qwix_layout(name):
    """to_peft and from_peft invert each other, and the stacked form keeps every projection's delta."""
    rng = np.random.default_rng(0)
    for t in targets(spec_of(name), PROJECTIONS):
        a_shape, b_shape = t.shapes(3)
        a, b = rng.normal(size=a_shape), rng.normal(size=b_shape)
        pairs = t.to_peft(a, b)
        assert len(pairs) == len(t.hf_modules)
        for (A, B), hf in zip(pairs, [t.entry.hf_shape] * len(pairs)):
            assert (B @ A).shape == hf
        stacked = t.from_peft(pairs)
        assert stacked[0].shape[-1] == 3 * len(pairs)
        for (A, B), (A2, B2) in zip(pairs, t.to_peft(*stacked)):
            np.testing.assert_allclose(B2 @ A2, B @ A, atol=1e-12)
        if len(pairs) == 1:
            np.testing.assert_array_equal(stacked[0], a)
            np.testing.assert_array_equal(stacked[1], b)


def test_stacked_spec_gives_fused_modules_their_own_rank():
    spec = spec_of("gemma3_qkv")
    stacked = dataclasses.replace(LoraSpec(4, 8.0), fused="stacked")
    rules = {r.rank: r for r in stacked.to_qwix(spec)._rules}
    assert set(rules) == {4, 12}
    assert "qkv_einsum" in rules[12].module_path and "qkv_einsum" not in rules[4].module_path
    assert all(r.alpha / r.rank == stacked.scale for r in rules.values())
