"""LoraSpec: PEFT <-> Qwix configs, and which Tunix modules PEFT targets mean."""

import dataclasses
import math
import re

import jax
import numpy as np
import peft
import pytest
import tiny

from gemport.errors import LoraError
from gemport.lora import PROJECTIONS, LoraLayout, LoraSpec
from gemport.specs import GemmaSpec


def spec_of(name):
    cfg = tiny.text_config(name).to_dict()
    return GemmaSpec.from_hf(cfg)


def lora_shapes(spec, lora_spec):
    """``{param path: shape}`` of the LoRA params apply_lora creates on ``spec``'s Tunix model (shapes only)."""
    from flax import nnx

    from gemport.lora import apply_lora

    def build():
        return apply_lora(spec.tunix_model_class()(spec.to_tunix(), rngs=nnx.Rngs(0)), spec, lora_spec)

    return {".".join(map(str, p)): tuple(v.get_value().shape)
            for p, v in nnx.to_flat_state(nnx.state(nnx.eval_shape(build), nnx.LoRAParam))}


def modules(spec, lora_spec):
    """Tunix module paths (``layers/0/attn/q_einsum``) that apply_lora puts LoRA on."""
    return {p.rsplit(".", 1)[0].replace(".", "/") for p in lora_shapes(spec, lora_spec)}


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
    (dict(init_lora_weights="pissa"), "import_peft"),
    (dict(target_modules=["q_proj", "fc1"]), "fc1"),
])
def test_from_peft_refuses_what_qwix_cannot_do(bad, why):
    config = dict(LoraSpec(8, 16.0).to_peft(), **bad)
    with pytest.raises(LoraError, match=why):
        LoraSpec.from_peft(config)


def test_rslora_scales_every_adapter_by_alpha_over_sqrt_r():
    spec = LoraSpec(16, 8.0, rslora=True)
    adapters = LoraLayout(spec_of("gemma3_1b"), spec).adapters
    assert {a.separate for a in adapters} == {False, True}  # kv_einsum's separate factors, q/o/mlp plain
    for adapter in adapters:
        assert all(s == pytest.approx(8.0 / math.sqrt(16)) == spec.scale for s in adapter.scales)


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


def test_module_paths_are_anchored_so_a_vision_tower_never_matches():
    from gemport.lora.qwix import _alternation

    pattern = _alternation(["layers/0/attn/q_einsum", "layers/1/attn/q_einsum"])
    assert re.fullmatch(pattern, "layers/1/attn/q_einsum")
    assert not re.fullmatch(pattern, "vision_encoder/layers/0/attn/q_einsum")
    assert not re.fullmatch(pattern, "layers/10/attn/q_einsum")


def test_kv_shared_layers_get_no_kv_lora():
    spec = spec_of("gemma4_ple")
    hit = modules(spec, LoraSpec(4, 8.0, ("k_proj", "v_proj")))
    assert hit and not any(int(m.split("/")[1]) >= spec.num_layers - spec.num_kv_shared_layers for m in hit)


@pytest.mark.parametrize("name, partial, module, ranks", [
    ("gemma4_dense", ("q_proj", "k_proj"), "kv_einsum", (4, 0)),
    ("gemma4_dense", ("q_proj", "v_proj"), "kv_einsum", (0, 4)),
    ("gemma3_qkv", ("q_proj", "v_proj"), "qkv_einsum", (4, 0, 4)),
])
def test_partial_fused_targets_get_zero_slots_and_shared_is_refused(name, partial, module, ranks):
    """The projections the targets leave out of a fused module are rank-0, scale-0 slots of separate factors,
    with no PEFT tensors; one shared lora_a cannot leave a projection out."""
    adapter = {a.module: a for a in LoraLayout(spec_of(name), LoraSpec(4, 8.0, partial))}[f"layers.0.attn.{module}"]
    assert adapter.ranks == ranks and adapter.scales == tuple(2.0 if r else 0.0 for r in ranks)
    fused = ("k_proj", "v_proj") if module == "kv_einsum" else ("q_proj", "k_proj", "v_proj")
    assert [m.split(".")[-1] for m in adapter.hf_modules] == [p for p, r in zip(fused, ranks) if r]
    out_size, in_size = adapter.entry.hf_shape
    assert adapter.num_params == 4 * (in_size + out_size) * sum(map(bool, ranks))
    with pytest.raises(LoraError, match=f"{module}.*fused='separate'"):
        LoraLayout(spec_of(name), LoraSpec(4, 8.0, partial, fused="shared")).adapters


def test_v_proj_copies_are_only_for_k_eq_v_layers():
    """k_proj without v_proj on a sliding layer's kv_einsum is one HF module of a fused pair, not a k_eq_v
    layer's k_einsum: vLLM needs no v_proj copy of it."""
    from gemport.checkpoint.peft_io import v_proj_copies

    spec = spec_of("gemma4_dense")
    copies = v_proj_copies(LoraLayout(spec, LoraSpec(4, 8.0, ("q_proj", "k_proj"))))
    assert copies and all(spec.layer_k_eq_v(int(k.split(".")[1])) for k in copies)
    assert not v_proj_copies(LoraLayout(spec, LoraSpec(4, 8.0, ("q_proj", "v_proj"))))


@pytest.mark.parametrize("fused, targets", [("separate", PROJECTIONS), ("shared", PROJECTIONS),
                                             ("separate", ("q_proj", "v_proj"))])
@pytest.mark.parametrize("name", ["gemma4_dense", "gemma3_qkv"])
def test_peft_layout_round_trips_through_qwix_layout(name, fused, targets):
    """to_peft and from_peft invert each other exactly; separate factors keep each projection's own A; a zero
    slot (a projection the targets leave out) has no PEFT pair and comes back zero."""
    rng = np.random.default_rng(0)
    for adapter in LoraLayout(spec_of(name), LoraSpec(3, 6.0, targets, fused=fused)):
        a_shape, b_shape = adapter.shapes
        a, b = rng.normal(size=a_shape), rng.normal(size=b_shape)
        if adapter.separate:  # as training keeps them: zero slots stay zero
            a[[i for i, r in enumerate(adapter.ranks) if not r]] = 0
            b[[i for i, r in enumerate(adapter.ranks) if not r]] = 0
        pairs = adapter.to_peft(a, b)
        assert len(pairs) == len(adapter.hf_modules)
        for A, B in pairs:
            assert (B @ A).shape == adapter.entry.hf_shape and A.shape[0] == 3
        if fused == "shared" and len(pairs) > 1:
            assert all(np.array_equal(A, pairs[0][0]) for A, _ in pairs)
            with pytest.raises(LoraError, match="separate"):
                adapter.from_peft(pairs)
            continue
        a2, b2 = adapter.from_peft(pairs)
        np.testing.assert_array_equal(a2, a)
        np.testing.assert_array_equal(b2, b)


def test_separate_factors_lead_with_the_stacking_axis():
    spec = spec_of("gemma4_dense")
    layout = {a.module: a for a in LoraLayout(spec, LoraSpec(4, 8.0))}
    kv = layout["layers.0.attn.kv_einsum"]
    assert (kv.a, kv.b) == ("s d r", "s r k h")
    assert kv.shapes == ((2, spec.hidden, 4), (2, 4, spec.num_kv_heads, spec.head_dim))
    assert kv.specs((None, "tp", "fsdp", None)) == ((None, "fsdp", None), (None, None, "tp", None))
    shared = {a.module: a for a in LoraLayout(spec, LoraSpec(4, 8.0, fused="shared"))}["layers.0.attn.kv_einsum"]
    assert (shared.a, shared.b) == ("d r", "r s k h")
    q = layout["layers.0.attn.q_einsum"]
    assert (q.a, q.b, q.specs(("tp", "fsdp", None))) == ("d r", "r n h", (("fsdp", None), (None, "tp", None)))


def test_per_module_ranks_and_scales_follow_peft_patterns():
    spec = spec_of("gemma4_dense")
    lora_spec = LoraSpec.from_peft(peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["k_proj", "v_proj", "o_proj"],
        rank_pattern={"v_proj": 2, "layers.1.self_attn.o_proj": 6}, alpha_pattern={"o_proj": 3}))
    layout = {a.module: a for a in LoraLayout(spec, lora_spec)}
    kv = layout["layers.0.attn.kv_einsum"]
    assert kv.ranks == (4, 2) and kv.rank == 4 and kv.scales == (2.0, 4.0)
    assert layout["layers.1.attn.attn_vec_einsum"].ranks == (6,)
    assert layout["layers.1.attn.attn_vec_einsum"].scales == (0.5,)
    assert layout["layers.0.attn.attn_vec_einsum"].scales == (0.75,)
    with pytest.raises(LoraError, match="fused='separate'"):
        LoraLayout(spec, dataclasses.replace(lora_spec, fused="shared")).adapters


@pytest.mark.parametrize("fused", ["separate", "shared"])
@pytest.mark.parametrize("name", ["gemma4_dense", "gemma4_ple", "gemma3_1b", "gemma3_qkv"])
def test_layout_is_what_qwix_builds(name, fused):
    """LoraLayout's factor names and shapes are exactly the LoRA params apply_lora creates (shapes only)."""
    lora_spec = LoraSpec(3, 6.0, fused=fused, rank_pattern={"o_proj": 2})
    assert lora_shapes(spec_of(name), lora_spec) == LoraLayout(spec_of(name), lora_spec).shapes()


@pytest.mark.parametrize("weight, x, stack, a, b", [
    ("skdh", "btd", None, "dr", "rskh"),
    ("skdh", "btd", "s", "sdr", "srkh"),
    ("nhd", "btnh", None, "nhr", "rd"),
    ("CKDH", "BSD", "C", "CDr", "CrKH"),
])
def test_factor_axes_is_qwix_rule(weight, x, stack, a, b):
    """Input axes of the weight go to lora_a then r; lora_b is r then the rest; a stacking axis leads both."""
    from gemport.lora import factor_axes

    assert tuple(map("".join, factor_axes(weight, x, stack=stack))) == (a, b)


def test_lora_on_an_abstract_model_never_searches_the_trace(monkeypatch):
    """LoRA's application to a model of shapes only (``nnx.eval_shape``: what the plan and the dry run compile)
    never walks the trace for a value's origin. JAX does so to word the error ``getattr(tracer, "sharding", None)``
    swallows, which Qwix and flax ask once per factor: Gemma 4 31B's 60 layers took 152.3 s to build so, and 3.1 s
    without (docs/tpu.md, "Speed")."""
    from jax._src.interpreters import partial_eval  # JAX's private frame: the search this test counts

    from gemport.run.model import lora_model

    searches = []
    find = partial_eval.JaxprStackFrame.find_progenitors
    monkeypatch.setattr(partial_eval.JaxprStackFrame, "find_progenitors",
                        lambda frame, tracer: searches.append(tracer) or find(frame, tracer))
    from flax import nnx

    spec = spec_of("gemma4_dense")
    factors = jax.tree.leaves(nnx.state(lora_model(spec, LoraSpec(2, 4.0)), nnx.LoRAParam))
    assert len(factors) == len(LoraLayout(spec, LoraSpec(2, 4.0)).shapes())
    assert searches == []
