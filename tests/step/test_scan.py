"""Decoder remat as a scan over blocks of layers (``step.scan``) against the unrolled decoder it replaces.

The step's loss and LoRA gradients on packed rows, scanned and unrolled, in float32 and in float64: in float64 the
two agree to float64's rounding (the same arithmetic), and in float32 the scanned step is as close to float64 as
the unrolled one is (its floor, measured in the same run). Which models scan, and which keep their loop.
"""

import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny
from float64 import assert_float32_close, tunix_float64
from flax import nnx
from packed_rows import rows
from repo_paths import ROOT

from gemport.lora import LoraSpec
from gemport.run.model import lora_model
from gemport.specs import GemmaSpec
from gemport.step import segment_loss
from gemport.errors import TrainingError
from gemport.step.remat import SAVED
from gemport.step.scan import ScannedLayers, decoder_period, scanned_decoder, scanned_period

# Five layers of a 2-layer pattern: two blocks scanned, one layer past them unrolled.
LAYERS = ("sliding", "global") * 2 + ("sliding",)
PRESETS = {"gemma3": "gemma3-1b", "gemma4": "gemma4-31b"}  # Gemma 4 31B's global layers: wider, k_eq_v
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def spec_of(family, layers=LAYERS):
    return dataclasses.replace(GemmaSpec.preset(PRESETS[family]), num_layers=len(layers), layer_types=layers,
                               hidden=32, mlp=48, num_heads=4, num_kv_heads=2, head_dim=8, vocab=96,
                               sliding_window=4, **({"global_head_dim": 16, "global_kv_heads": 1}
                                                    if family == "gemma4" else {}))


def model_of(spec, dtype, remat="decoder", lora=LoraSpec(rank=2, alpha=4, targets=TARGETS), abstract=False):
    model = lora_model(spec, lora, param_dtype=dtype, remat=remat, abstract=abstract)
    if abstract:
        return model
    key = jax.random.key(1)
    for _, p in nnx.iter_graph(model):  # B starts at zero: give the adapter a non-zero delta
        if isinstance(p, nnx.LoRAParam):
            key, sub = jax.random.split(key)
            p.set_value((0.1 * jax.random.normal(sub, p.get_value().shape)).astype(dtype))
    return model


def loss_and_grads(model, batch, monkeypatch, scan):
    with monkeypatch.context() as m:
        if not scan:
            m.setattr("gemport.step.hf.scanned_decoder", lambda model: model)
        loss, grads = nnx.jit(nnx.value_and_grad(lambda model: segment_loss(model, batch)[0],
                                                 argnums=nnx.DiffState(0, nnx.LoRAParam)))(model)
    flat = np.concatenate([np.ravel(v.get_value()) for _, v in nnx.to_flat_state(grads)])
    return np.float64(loss), flat.astype(np.float64)


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_the_scanned_decoder_trains_as_the_unrolled_one(family, monkeypatch):
    """Under each remat the scan takes (``step.remat.SAVED``: what a layer keeps changes what is recomputed, not
    the values); unrolled, the model runs Tunix's decoder remat."""
    spec = spec_of(family)
    tokens, positions, segment_ids, loss_mask = rows(spec.vocab)
    batch = dict(tokens=tokens, positions=positions, segment_ids=segment_ids, loss_mask=loss_mask)
    models = {remat: model_of(spec, jnp.float32, remat=remat) for remat in SAVED}
    blocks = scanned_decoder(models["decoder"]).layers[0]  # Gemma 3 cycles its own pattern: five sliding, period 1
    assert isinstance(blocks, ScannedLayers) and len(blocks.layers) // blocks.period >= 2
    runs = [(remat, True) for remat in SAVED] + [("decoder", False)]
    float32 = {run: loss_and_grads(models[run[0]], batch, monkeypatch, run[1]) for run in runs}
    # gemport's attention and loss accumulate in float32 too
    with tunix_float64(monkeypatch, also=("gemport.step.attention", "gemport.step.chunked_loss")):
        float64 = {}
        for remat, scan in (("decoder", True), ("decoder", False)):  # the arithmetic; "projections" saves more of it
            graphdef, state = nnx.split(model_of(spec, jnp.float64, remat=remat))  # a float64 model (config too)...
            model64 = nnx.merge(graphdef, jax.tree.map(lambda a, b: b.astype(a.dtype), state,
                                                       nnx.split(models[remat])[1]))  # ... with float32's weights
            float64[remat, scan] = loss_and_grads(model64, batch, monkeypatch, scan)
    unrolled = ("decoder", False)
    for i, quantity in enumerate(("loss", "LoRA gradients")):
        exact, other = float64[unrolled][i], float64["decoder", True][i]
        assert np.abs(exact).max() > 0, quantity
        for remat in SAVED:
            # float32's floor: the unrolled step's distance from float64; each scanned step within 10x of it
            assert_float32_close(float32[remat, True][i], float32[unrolled][i], exact)
        floor32 = np.abs(float32[unrolled][i] - exact).max() / np.abs(exact).max()
        # float64: the same arithmetic, so the two differ by float64's rounding of float32's noise at most
        bound = 10 * floor32 * np.finfo(np.float64).eps / np.finfo(np.float32).eps
        assert np.abs(other - exact).max() / np.abs(exact).max() <= bound, quantity


def test_a_14_layer_gemma3_scans_two_blocks_of_six_and_leaves_the_model_as_it_was():
    """Gemma 3 1B's 26 layers scan as four blocks of six the same way, the last two layers after the scan (shapes
    only: no compile)."""
    spec = dataclasses.replace(GemmaSpec.preset("gemma3-1b"), num_layers=14,
                               layer_types=(("sliding",) * 5 + ("global",)) * 2 + ("sliding",) * 2,
                               hidden=32, mlp=48, num_heads=4, num_kv_heads=1, head_dim=8, vocab=96)
    model = model_of(spec, jnp.float32, abstract=True)
    assert decoder_period([nnx.split(layer) for layer in model.layers]) == 6
    before = [type(m) for _, m in nnx.iter_modules(model)]
    scanned = scanned_decoder(model)
    first = scanned.layers[0]
    assert isinstance(first, ScannedLayers) and (first.period, len(first.layers), len(scanned.layers)) == (6, 14, 1)
    assert [type(m) for _, m in nnx.iter_modules(model)] == before
    assert first.layers[7].attn.q_einsum.w is not None


@pytest.mark.parametrize("case", ["no remat", "per-layer inputs and KV sharing", "per-layer alpha", "one block"])
def test_these_keep_their_loop(case):
    """The scan runs under decoder remat, on layers that read nothing of other layers', under one LoRA rule, over
    two blocks or more."""
    if case == "one block":
        model = model_of(spec_of("gemma4", ("sliding", "global")), jnp.float32, abstract=True)
    elif case == "per-layer inputs and KV sharing":
        model = model_of(GemmaSpec.from_hf(tiny.text_config("gemma4_ple").to_dict()), jnp.float32, abstract=True)
    elif case == "per-layer alpha":
        model = model_of(spec_of("gemma3"), jnp.float32, abstract=True, lora=LoraSpec(
            rank=2, alpha=4, targets=TARGETS, alpha_pattern=(("layers.0.self_attn.q_proj", 8.0),)))
    else:
        model = model_of(spec_of("gemma3"), jnp.float32, remat="none", abstract=True)
    assert not any(isinstance(m, ScannedLayers) for _, m in nnx.iter_modules(scanned_decoder(model)))


LORA = LoraSpec(rank=2, alpha=4, targets=TARGETS)


@pytest.mark.parametrize("case", ["per-layer inputs and KV sharing", "per-layer alpha"])
def test_remat_projections_is_refused_where_the_decoder_keeps_its_loop(case):
    """Only the scan keeps the projections' products: a model it cannot scan is refused, not run under another
    remat."""
    if case == "per-layer alpha":
        spec, lora = spec_of("gemma3"), LoraSpec(rank=2, alpha=4, targets=TARGETS,
                                                 alpha_pattern=(("layers.0.self_attn.q_proj", 8.0),))
    else:
        spec, lora = GemmaSpec.from_hf(tiny.text_config("gemma4_ple").to_dict()), LORA
    model = model_of(spec, jnp.float32, remat="projections", lora=lora, abstract=True)
    with pytest.raises(TrainingError, match="remat 'projections'.*cannot be scanned"):
        scanned_decoder(model)
    assert scanned_period(spec, lora, "projections") == 0


PERIODS = {  # spec, LoRA, remat: what the plan reads the scan from
    "gemma3-1b 14 layers": (dataclasses.replace(spec_of("gemma3"), num_layers=14,
                                                layer_types=GemmaSpec.preset("gemma3-1b").layer_types[:14]),
                            LORA, "decoder"),
    "31b 4 sliding": (spec_of("gemma4", ("sliding",) * 4), LORA, "decoder"),
    "31b 12 layers": (spec_of("gemma4", GemmaSpec.preset("gemma4-31b").layer_types[:12]), LORA, "decoder"),
    "block remat": (spec_of("gemma4"), LORA, "block"),
    "one block, projections": (spec_of("gemma4", ("sliding", "global")), LORA, "projections"),
    "31b 4 sliding, projections": (spec_of("gemma4", ("sliding",) * 4), LORA, "projections"),
    "one layer's rank": (spec_of("gemma4", ("sliding", "global") * 4), LoraSpec(
        rank=2, alpha=4, targets=TARGETS, rank_pattern=(("layers.2.self_attn.q_proj", 4),)), "decoder"),
    "per-layer alpha": (spec_of("gemma3"), LoraSpec(rank=2, alpha=4, targets=TARGETS,
                                                    alpha_pattern=(("layers.0.self_attn.q_proj", 8.0),)), "decoder"),
    "per-layer inputs and KV sharing": (GemmaSpec.from_hf(tiny.text_config("gemma4_ple").to_dict()), LORA, "decoder"),
}


@pytest.mark.parametrize("case", PERIODS)
def test_the_plans_period_is_the_scans(case):
    """``scanned_period`` (the memory plan's reading of the spec) is the period ``scanned_decoder`` scans the model
    in, 0 where it keeps the loop."""
    spec, lora, remat = PERIODS[case]
    model = model_of(spec, jnp.float32, remat=remat, lora=lora, abstract=True)
    blocks = [m for _, m in nnx.iter_modules(scanned_decoder(model)) if isinstance(m, ScannedLayers)]
    assert scanned_period(spec, lora, remat) == (blocks[0].period if blocks else 0)


def test_the_recorded_compiles_cover_12_to_60_layers_and_what_the_scan_holds():
    """``bench/bench_compile.py --record bench/compile.jsonl``'s figures (Gemma 4 31B's widths, the bundled recipe),
    whose compiled peaks are deterministic: each depth compiled both ways on this host's CPU, where the scanned
    step holds less than the unrolled one (XLA:CPU's float32 copies of every layer's weights); for a TPU slice the
    scanned step holds at most one block's weights more (the copy its choice of weights makes), as the plan
    counts it. Compile seconds are read by docs/tpu.md, not judged here."""
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_compile

    records = [json.loads(line) for line in (ROOT / "bench" / "compile.jsonl").read_text().splitlines() if line]
    peaks = {(r["target"], r["layers"], r["scanned"]): r for r in records}
    assert {(layers, scanned) for target, layers, scanned in peaks if target == "cpu"} >= {
        (12, False), (12, True), (60, False), (60, True)}
    assert any(target != "cpu" and (target, layers, False) in peaks for target, layers, scanned in peaks if scanned)
    for (target, layers, scanned), r in peaks.items():
        if not scanned or (target, layers, False) not in peaks:
            continue
        unrolled = peaks[target, layers, False]["peak_bytes"]
        if target == "cpu":
            assert r["peak_bytes"] < unrolled, (target, layers)
        else:
            assert 0 < r["peak_bytes"] - unrolled <= bench_compile.planned(r).step.scanned_bytes, (target, layers)
