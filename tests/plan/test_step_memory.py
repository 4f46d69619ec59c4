"""The memory plan of a train step against the peak XLA compiles the LoRA step to (compiled memory analysis).

Both steps: gemport's fast step (the default: segment attention in tiles, the loss in blocks of logits), which
the plan counts, and Tunix's own (its attention's scores, [B, T, V] logits), which the plan states beside it.
The step is the one ``SFTRun.train()`` runs (``gemport.plan.compiled_peak``: ``HFPeftTrainer``'s jitted step with
TRL's default recipe: HF's AdamW, clipping, schedule and accumulation, state donated), lowered for abstract arguments
and compiled, never run, in a subprocess: XLA:CPU needs its memory-ordered scheduler
(a flag read at start-up) for remat to save anything, as it does on accelerators. Params are float32, since
XLA:CPU computes bfloat16 in float32 and would not match a bf16 plan. The real-width cases are Gemma 4 31B's
widths (hidden 5376, MLP 21504, 32 heads, 16 x 256 sliding and 4 x 512 global KV heads) with 2 layers (one
sliding, one global) and an 8192-token vocabulary (the full 262144 adds nothing new but compile time).
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from gemport.lora import LoraSpec
from gemport.mesh import MeshError
from gemport.plan import memory_plan
from gemport.specs import GemmaSpec
from gemport.step import segment_loss, tunix_loss
from repo_paths import HELPERS, ROOT

BENCH = ROOT / "bench"
G31 = GemmaSpec.preset("gemma4-31b")
WIDE = dataclasses.replace(G31, num_layers=2, layer_types=("sliding", "global"), vocab=8192)

# (spec name, remat, fsdp, batch, seq_len)
CASES = [
    ("gemma4_dense", "none", 1, 8, 128),
    ("gemma4_dense", "decoder", 1, 8, 128),
    ("gemma4_dense", "none", 4, 8, 128),
    ("gemma4_moe", "none", 1, 8, 128),  # the experts resident, tokens reaching their top 2 through ragged_dot
    ("gemma3_1b", "none", 1, 2, 16),
    ("wide", "none", 1, 1, 1024),
    ("wide", "block", 1, 1, 1024),
]
# Widths bitsandbytes' 64-element blocks tile, the projections most of the parameters: a 4-bit base shows.
QLORA = dict(model_type="gemma4_text", vocab_size=512, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64, global_head_dim=128,
             num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=4,
             layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=0,
             final_logit_softcapping=30.0)
QLORA_CASE = ("qlora", "none", 1, 1, 32)
# The fast step over fsdp=4 compiles to 2.6x less than on one device, not 4x: Tunix skips its activation
# sharding constraints on CPU (tunix.utils.sharding_utils.shard), and without them XLA keeps the MLP
# activations of all rows on every device (Tunix's own step gets the rows' split from its [B, T, T] mask). The
# plan assumes the rows split, as they do under Tunix's constraints on an accelerator; that case is not compared.
FAST_CASES = [c for c in CASES if c[2] == 1]
# Tunix's step without remat variants: remat is proved on the step gemport trains with, and the suite has a budget.
TUNIX_CASES = [c for c in CASES if c[1] == "none"]

_CHILD = r"""
import dataclasses, json, sys
import jax, jax.numpy as jnp
sys.path[:0] = [{bench!r}, {tests!r}]
import tiny
from gemport.lora import LoraSpec, QLoraSpec
from gemport.plan import compiled_peak
from gemport.step import segment_loss, tunix_loss
from gemport.specs import GemmaSpec
from gemport.step import segment_loss, tunix_loss
import transformers
qlora_spec = GemmaSpec.from_hf(transformers.Gemma4TextConfig(**{qlora!r}).to_dict())
wide = dataclasses.replace(GemmaSpec.preset("gemma4-31b"), num_layers=2, layer_types=("sliding", "global"), vocab=8192)
for fast, (name, remat, fsdp, batch, seq_len), base in {cases!r}:
    spec = {{"wide": wide, "qlora": qlora_spec}}.get(name) or GemmaSpec.from_hf(tiny.text_config(name).to_dict())
    # decoder / none through the recipe's gradient_checkpointing, as a run sets them; block as Tunix names it
    recipe = {{"remat": remat}} if remat == "block" else {{"args": {{"gradient_checkpointing": remat == "decoder"}}}}
    peak = compiled_peak(spec, LoraSpec(rank=4, alpha=8), fsdp, 1, batch=batch, seq_len=seq_len,
                         param_dtype=base.replace("nf4", "float32"),
                         loss_fn=segment_loss if fast else tunix_loss,
                         qlora=QLoraSpec() if base == "nf4" else None, **recipe)
    print(json.dumps(peak), flush=True)
"""


def _spec(name):
    if name == "wide":
        return WIDE
    if name == "qlora":
        import transformers

        return GemmaSpec.from_hf(transformers.Gemma4TextConfig(**QLORA).to_dict())
    import tiny

    return GemmaSpec.from_hf(tiny.text_config(name).to_dict())


def _measure(cases):
    sys.path.insert(0, str(BENCH))
    from gemport.plan.compiled import CPU_MEMORY_SCHEDULER

    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count=8 {CPU_MEMORY_SCHEDULER}")
    code = _CHILD.format(bench=str(BENCH), tests=str(HELPERS), cases=cases, qlora=QLORA)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines()]


@pytest.fixture(scope="module")
def peaks():
    """{(fast, case): compiled peak bytes}: the fast step on FAST_CASES, Tunix's on TUNIX_CASES (float32 bases); and
    {(True, QLORA_CASE, base): ...} for the fast step on a bfloat16 and on a 4-bit (float32 compute) base."""
    runs = ([(True, c, "float32") for c in FAST_CASES] + [(False, c, "float32") for c in TUNIX_CASES]
            + [(True, QLORA_CASE, b) for b in ("bfloat16", "nf4")])
    measured = dict(zip(runs, _measure(runs)))
    return {**{k[:2]: v for k, v in measured.items() if k[1] != QLORA_CASE}, **measured}



def _plan(case, qlora=None):
    name, remat, fsdp, batch, seq_len = case
    return memory_plan(_spec(name), fsdp, 1, lora_spec=LoraSpec(4, 8.0), param_dtype="float32", batch=batch,
                       seq_len=seq_len, remat=remat, backend="cpu", qlora=qlora)


def test_the_4bit_base_compiles_below_the_bf16_one_and_is_planned_within_15_percent(peaks):
    """The train step on the 4-bit base ``load_qlora_model`` places (uint4 codes, float32 scales) against a
    bfloat16 base. XLA:CPU holds every dequantized weight through the step (as it holds a float32 copy of each
    bfloat16 one); the CPU plan counts them."""
    from gemport.lora import QLoraSpec

    four_bit, bf16 = peaks[(True, QLORA_CASE, "nf4")], peaks[(True, QLORA_CASE, "bfloat16")]
    assert four_bit < bf16
    plan = _plan(QLORA_CASE, QLoraSpec())
    assert abs(plan.total_bytes / four_bit - 1) <= 0.15, (plan.total_bytes, four_bit, str(plan))


# The estimate was fitted to a step of its own (no clipping, plain AdamW, every argument donated). The step that
# trains donates the model and optimizer as that one did (HFPeftTrainer.jitted_train_step; before, Tunix's nnx.jit
# returned the base in new buffers, and the 31B-width cases were 10.07 GB compiled against 6.57 GB planned), and the
# plan matches it at real widths without remat. It does not count one difference, on XLA:CPU only (strict: these
# fail once XLA:CPU changes or the plan gains a CPU term): the step clips the gradient (TRL's max_grad_norm 1.0),
# and with clipping XLA:CPU holds about 2.5x the temporaries of the same step without it under remat (gemma4_dense,
# 8 x 128, decoder: 33.3 MB against 13.4 MB; without remat 15% more). libtpu does not: its compile-only figures of
# the clipped step at 31B widths are within 0% to 13% of the plan, which counts no clipping (LIBTPU_PEAKS below).
UNFITTED = {("gemma4_dense", "decoder", 1, 8, 128), ("wide", "block", 1, 1, 1024)}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.xfail(strict=True, reason="XLA:CPU holds "
                                                                          "clipping's temporaries under remat"))
                                  if c in UNFITTED else c for c in FAST_CASES], ids=lambda c: "-".join(map(str, c)))
def test_plan_is_within_15_percent_of_the_compiled_fast_step(peaks, case):
    plan = _plan(case)
    assert plan.step.loss_fn is segment_loss
    assert abs(plan.total_bytes / peaks[(True, case)] - 1) <= 0.15, (plan.total_bytes, peaks[(True, case)], str(plan))


# What libtpu compiles the trained step to at Gemma 4 31B's widths (2 layers, vocabulary 262144) with the bundled
# recipe (examples/sft_verilog.yaml: LoRA r=8 x 7, bf16, 2 rows per micro-batch, 2 micro-batches, clipping, decoder
# remat), on the mesh `gemport sft --dry-run --tpu SLICE` picks unless the line names another: peak bytes per chip,
# compile-only. Each line of the file is one figure as `python bench/bench_plan_fit.py --record FILE` wrote it, with
# libtpu's and jax's versions and the date. The suite cannot afford these compiles (minutes and GBs each); rerun
# the bench and replace the file when the step or libtpu changes.
LIBTPU_PEAKS = [json.loads(line) for line in (BENCH / "plan_fit_libtpu.jsonl").read_text().splitlines() if line]


@pytest.mark.parametrize("figure", LIBTPU_PEAKS, ids=lambda m: f"{m['tpu']}-{m['fsdp']}x{m['tp']}-{m['seq_len']}")
def test_plan_is_within_15_percent_of_what_libtpu_compiles_at_31b_widths(figure):
    """The plan's estimate (no compile) against a recorded compile-only peak of the step that trains."""
    sys.path.insert(0, str(BENCH))
    import bench_plan_fit

    spec = bench_plan_fit.spec_of(figure["layers"])
    assert figure["rows"] == bench_plan_fit.recipe()[0]["per_device_train_batch_size"]
    plan = bench_plan_fit.estimate(spec, figure["fsdp"], figure["tp"], figure["rows"], figure["seq_len"])
    assert abs(plan.total_bytes / figure["peak_bytes"] - 1) <= 0.15, (plan.total_bytes, figure, str(plan))


def test_plan_is_within_15_percent_of_what_libtpu_compiles_for_the_scanned_decoder_at_depth():
    """The plan's estimate against libtpu's compile-only peak of the step at depth, its decoder scanned in blocks
    (``gemport.step.scan``: the figures above are of two layers, one block, unrolled): ``bench/bench_compile.py
    --tpu``'s records in bench/compile.jsonl, the bundled recipe at Gemma 4 31B's widths."""
    sys.path.insert(0, str(BENCH))
    import bench_compile

    figures = [json.loads(line) for line in (BENCH / "compile.jsonl").read_text().splitlines() if line]
    scanned = [m for m in figures if m["target"] != "cpu" and m["scanned"]]
    assert {m["layers"] for m in scanned} >= {60}
    for m in scanned:
        plan = bench_compile.planned(m)
        assert abs(plan.total_bytes / m["peak_bytes"] - 1) <= 0.15, (plan.total_bytes, m, str(plan))


# `python bench/bench_tpu.py --compile-only`: the chip bench's steps compiled for one v5e by libtpu on this host.
V5E = [json.loads(line) for line in (BENCH / "tpu_compiled.jsonl").read_text().splitlines() if line]
# Where the plan misses libtpu's compile for one v5e by more than 15%, not yet understood: Gemma 3 1B's widths
# (under by 21% under decoder remat, 29% under "projections"), 31B's first four layers under decoder remat (over
# by 16%). A strict xfail: each fails once the plan meets the compile.
V5E_GAPS = {"1b-26", "1b-26-projections", "31b-4"}


@pytest.mark.parametrize("record", [pytest.param(r, marks=pytest.mark.xfail(strict=True, reason="the plan misses "
                                                                             "libtpu's one-chip compile"))
                                    if r["case"] in V5E_GAPS else r for r in V5E], ids=lambda r: r["case"])
def test_plan_is_within_15_percent_of_what_libtpu_compiles_for_one_v5e(record):
    sys.path.insert(0, str(BENCH))
    import bench_tpu

    assert record["target"] == "v5e-1" and record["libtpu"]
    assert abs(bench_tpu.planned(record["case"]).total_bytes / 2**30 / record["compiled_gib"] - 1) <= 0.15


def test_the_projections_cost_libtpu_more_than_decoder_remat_and_the_plan_says_so():
    """Compiled for one v5e, remat "projections" holds more than decoder remat at both widths (past the chip's
    15.75 GiB: docs/tpu.md), and the plan does not claim it fits."""
    sys.path.insert(0, str(BENCH))
    import bench_tpu

    compiled = {r["case"]: r["compiled_gib"] for r in V5E}
    for case in ("1b-26", "31b-4"):
        assert compiled[case + "-projections"] > compiled[case]
        assert bench_tpu.planned(case + "-projections").total_bytes > bench_tpu.planned(case).total_bytes
    assert bench_tpu.planned("31b-4-projections").fits is False


def test_the_recorded_libtpu_figures_cover_the_dry_run_meshes():
    """One v5p chip, a v5p-8 and a v6e-8, at 4096 and 8192 tokens, each on the mesh the dry run picks."""
    sys.path.insert(0, str(BENCH))
    import bench_plan_fit

    chips = {"v5p-2": 1, "v5p-8": 4, "v6e-8": 8}
    spec = bench_plan_fit.spec_of(2)
    covered = {(m["tpu"], m["seq_len"]) for m in LIBTPU_PEAKS
               if (m["fsdp"], m["tp"]) == bench_plan_fit.mesh_sizes(spec, chips[m["tpu"]])}
    assert covered >= {(c.split(":")[0], int(c.split(":")[1])) for c in bench_plan_fit.CASES}


def test_fsdp_gathers_the_largest_weight_and_one_embedding_slice():
    """Under fsdp a dot's weight is all-gathered over fsdp into a temporary of its tp shard, one at a time (libtpu's
    program for 31B widths on a v6e-8 gathers each [5376, 21504 / 4] MLP weight and each [262144 / 16 / 4, 5376]
    embedding slice): the plan counts the largest of each; none without fsdp."""
    spec = dataclasses.replace(G31, num_layers=2, layer_types=("sliding", "global"))
    plan = memory_plan(spec, 2, 4, lora_spec=LoraSpec(16, 32.0), batch=8, seq_len=2048)
    assert plan.step.gathered_bytes == (5376 * 21504 // 4 + 262144 // 16 // 4 * 5376) * 2
    assert plan.tunix_step.gathered_bytes == (5376 * 21504 // 4 + 262144 // 4 * 5376) * 2  # Tunix's logits: all of it
    assert "fsdp-gathered weights" in str(plan)
    assert memory_plan(spec, 1, 4, lora_spec=LoraSpec(16, 32.0), batch=8, seq_len=2048).step.gathered_bytes == 0


@pytest.mark.parametrize("case", TUNIX_CASES, ids=lambda c: "-".join(map(str, c)))
def test_what_tunix_step_would_need_is_within_15_percent_of_its_compiled_peak(peaks, case):
    plan = _plan(case)
    assert plan.tunix_step.loss_fn is tunix_loss and "Tunix's own step" in plan.tunix_line
    assert abs(plan.tunix_total_bytes / peaks[(False, case)] - 1) <= 0.15, (plan.tunix_total_bytes, peaks[(False, case)])


def test_remat_shrinks_the_plan_as_it_shrinks_the_compiled_step(peaks):
    """Decoder remat from the recipe's ``gradient_checkpointing: true`` (TRL's default) against ``false``, at 8 rows
    of 128 tokens (the layers' activations outweigh the state), and Tunix's block remat at 31B widths."""
    for name, remat, batch, seq_len in (("gemma4_dense", "decoder", 8, 128), ("wide", "block", 1, 1024)):
        plans = {r: memory_plan(_spec(name), 1, 1, lora_spec=LoraSpec(4, 8.0), param_dtype="float32", batch=batch, seq_len=seq_len,
                                remat=r).step.activation_bytes for r in ("none", remat)}
        assert plans[remat] < plans["none"]
        assert peaks[(True, (name, remat, 1, batch, seq_len))] < peaks[(True, (name, "none", 1, batch, seq_len))]


@pytest.mark.parametrize("name", ["gemma4_dense", "gemma3_1b"])
def test_the_plan_keeps_the_products_the_step_names(name, monkeypatch):
    """What the plan adds under remat "projections" is, per token, every product the LoRA provider names
    ``lora.qwix.PROJECTION`` in a forward pass of the model (each layer traced once, unrolled), in the compute
    dtype."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import gemport.lora.qwix
    from gemport.run.model import lora_model
    from gemport.step import segment_loss

    spec, lora, rows, seq_len = _spec(name), LoraSpec(4, 8.0), 2, 8
    model = lora_model(spec, lora, param_dtype=jnp.float32, remat="projections", abstract=False)
    named = []
    monkeypatch.setattr(gemport.lora.qwix, "checkpoint_name", lambda x, n: named.append(x) or x)
    monkeypatch.setattr("gemport.step.hf.scanned_decoder", lambda model: model)
    batch = {k: np.ones((rows, seq_len), np.int32) for k in ("tokens", "positions", "segment_ids", "loss_mask")}
    nnx.eval_shape(lambda model: segment_loss(model, batch)[0], model)
    per_token = sum(x.size for x in named) / (rows * seq_len)
    plans = {r: memory_plan(spec, 1, 1, lora_spec=lora, param_dtype="float32", batch=rows, seq_len=seq_len, remat=r)
             for r in ("decoder", "projections")}
    extra = plans["projections"].step.activation_bytes - plans["decoder"].step.activation_bytes
    assert per_token > 0 and extra == pytest.approx(rows * seq_len * per_token * 4, abs=1)


def test_the_fast_step_needs_less_than_tunix_step_at_long_rows():
    plan = memory_plan(G31, 2, 4, lora_spec=LoraSpec(16, 32.0), batch=8, seq_len=8192, remat="decoder")
    assert plan.step.logits_bytes * 100 < plan.tunix_step.logits_bytes
    assert plan.step.activation_bytes < plan.tunix_step.activation_bytes
    assert plan.tunix_total_bytes > plan.total_bytes


def test_a_plan_without_a_batch_claims_no_fit():
    plan = memory_plan(G31, 2, 4, lora_spec=LoraSpec(16, 32.0), hbm_bytes="v6e")
    assert plan.step is None and plan.fits is None
    assert "before the train step (no batch/seq_len given)" in str(plan)
    assert str(plan).endswith("state fits; plan a batch to know if the step does")
    full = memory_plan(G31, 1, 1, hbm_bytes="v6e")
    assert full.fits is False and str(full).endswith("does not fit")  # the weights alone do not fit


def test_the_step_is_counted_and_named():
    plan = memory_plan(G31, 2, 4, lora_spec=LoraSpec(16, 32.0), hbm_bytes="v6e", batch=8, seq_len=2048)
    step = plan.step
    assert step.gradient_bytes == plan.lora_bytes  # one gradient per LoRA param, sharded alike
    assert plan.total_bytes == plan.base_bytes + plan.lora_bytes + plan.optimizer_bytes + step.total_bytes
    text = str(plan)
    for part in ("gradients", "activations", "logits and loss", "batch 8 x 2048 tokens, remat none, fast step"):
        assert part in text
    remat = memory_plan(G31, 2, 4, lora_spec=LoraSpec(16, 32.0), hbm_bytes="v6e", batch=8, seq_len=2048, remat="decoder")
    assert remat.step.activation_bytes < step.activation_bytes / 10
    # Rows split over fsdp, widths over tp: four times the devices along either axis, a quarter the activations.
    one = memory_plan(G31, 1, 1, lora_spec=LoraSpec(16, 32.0), batch=8, seq_len=2048).step.activation_bytes
    assert memory_plan(G31, 4, 1, lora_spec=LoraSpec(16, 32.0), batch=8, seq_len=2048).step.activation_bytes == one // 4
    assert abs(memory_plan(G31, 1, 4, lora_spec=LoraSpec(16, 32.0), batch=8, seq_len=2048).step.activation_bytes * 4 / one - 1) < 1e-6


def test_bad_step_arguments_are_typed_errors():
    with pytest.raises(MeshError, match="remat='full': expected one of none, block, decoder"):
        memory_plan(G31, 1, 1, batch=1, seq_len=8, remat="full")
    with pytest.raises(MeshError, match="batch=6 does not divide over fsdp=4"):
        memory_plan(G31, 4, 1, batch=6, seq_len=8)


@pytest.mark.parametrize("name", ["gemma4_dense", "gemma3_1b"])
def test_vocabulary_slices_give_the_full_logits_loss_and_gradients(hf_checkpoint, name):
    """The chunked loss over interleaved vocabulary slices (7 tokens by 16 of 96 rows, or 16 of 128, a block at
    a time, each slice four runs of 4 rows) against Tunix's full logits: the summed loss, the LoRA gradients and
    the tied embedding's gradient (full fine-tuning; under LoRA nothing reads it)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import tiny
    from flax import nnx
    from packed_rows import lora_model, rel_err, rows, summed_loss

    from gemport.data import attention_mask
    from gemport.step.chunked_loss import hidden_states, num_slices, run_rows, target_nll

    vocab = tiny.text_config(name).vocab_size
    slices = num_slices(vocab, 22)
    assert slices > 2 and vocab // slices // run_rows(vocab, slices, 4) == 4  # each slice four runs
    model = lora_model(hf_checkpoint, name)
    tokens, positions, segment_ids, loss_mask = rows(vocab)
    mask = attention_mask(segment_ids)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, sliced):
        m = nnx.merge(graphdef, params, rest)
        if sliced:
            nll = target_nll(m, hidden_states(m, tokens, positions, mask), tokens, chunk=7, vocab_slice=22, run=4)
            return jnp.where(loss_mask[:, 1:], nll, 0.0).sum()
        return summed_loss(m(tokens, positions, None, mask)[0], tokens, loss_mask)

    both = jax.jit(lambda params: [jax.value_and_grad(loss)(params, sliced) for sliced in (False, True)])
    (ref, ref_grads), (got, got_grads) = both(params)
    np.testing.assert_allclose(got, ref, rtol=1e-6)
    ref_flat = dict(nnx.to_flat_state(ref_grads))
    # The LoRA factors (what LoRA trains) and the embedding (whose decode gradient is the sliced backward's).
    compared = [(p, g) for p, g in nnx.to_flat_state(got_grads) if "input_embedding" in p or "lora" in str(p[-1])]
    assert sum("input_embedding" in p for p, _ in compared) == 1 and len(compared) > 10
    for path, g in compared:
        r = ref_flat[path].get_value()
        assert float(jnp.max(jnp.abs(r))) > 0, path
        assert rel_err(g.get_value(), r) < 1e-5, path


def test_plan_command_plans_the_4bit_base_and_tunix_step(capsys):
    from gemport.cli import main

    args = ["plan", "gemma4-31b", "--devices", "8", "--hbm", "v6e", "--lora-rank", "16", "--batch", "8",
            "--seq-len", "2048", "--remat", "decoder"]
    assert main(args) == 0
    full = capsys.readouterr().out
    assert main(args + ["--qlora", "nf4"]) == 0
    four_bit = capsys.readouterr().out
    assert "a bfloat16 base" in full and "a 4-bit (nf4) base" in four_bit
    assert "fsdp=2 tp=4: base 7.15 GiB" in full and "fsdp=2 tp=4: base 2.25 GiB" in four_bit
    assert full.count("Tunix's own step") == four_bit.count("Tunix's own step") == 3
    assert main(["plan", "gemma4-31b", "--devices", "8", "--qlora", "nf4"]) == 2
    assert "--qlora trains LoRA on the 4-bit base" in capsys.readouterr().err
