"""The trained step's speed on a TPU chip, as ``bench/bench_tpu.py --record bench/tpu.jsonl`` recorded it
(docs/benchmarks.md, "On the chip"): every figure is of a TPU, of a case the bench still runs, with the fields a reader
needs, and its derived figures (tokens/s, MFU) follow from its measured ones and today's FLOP count, so a change to
the count or to a case's model shows here. Timings are read, not judged: rerun the bench on a TPU to renew them."""

import json
import sys

import numpy as np
import pytest
from repo_paths import ROOT

BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))
import bench_tpu  # noqa: E402
import flops  # noqa: E402

from gemport.step.fit import FIT  # noqa: E402

RECORDS = [json.loads(line) for line in (BENCH / "tpu.jsonl").read_text().splitlines() if line.strip()]
STEPS = [r for r in RECORDS if r["case"] in bench_tpu.CASES and "ms" in r]

HBM_GIB = {"TPU v5 lite": 15.75}
"""Each recorded chip's HBM (a v5e's 16 GB)."""


def test_the_record_is_of_a_tpu_with_the_chips_rate_and_the_headline_steps():
    # compile-60 is libtpu compiling for a slice on the TPU host's CPU (JAX there sees no chip): of that host
    on_chip = [r for r in RECORDS if r["case"] != "compile-60"]
    assert RECORDS and all("TPU" in r["device_kind"] and r["jax"] and r["libtpu"] for r in on_chip)
    assert all(r["target"] == "v5p-8" and r["host_cpus"] and r["libtpu"] for r in RECORDS if r not in on_chip)
    assert all(r["case"] in bench_tpu.ORDER or r["case"].endswith(" layers") for r in RECORDS)
    cases = {r["case"] for r in RECORDS}
    assert {"matmul", "1b-26", "31b-4"} <= cases
    for r in RECORDS:
        if r["case"] == "matmul":
            assert 0 < r["tflops"] <= flops.peak_tflops(r["device_kind"])


@pytest.mark.parametrize("record", STEPS, ids=[r["case"] for r in STEPS])
def test_each_steps_figures_follow_from_what_was_measured(record):
    preset, layers, rows, seq_len, loss, remat = bench_tpu.CASES[record["case"]]
    spec = bench_tpu.spec_of(preset, layers)
    # the first records, before "projections", ran decoder remat
    assert (record["model"], record["layers"], record["rows"], record["seq_len"], record["loss"],
            record.get("remat", "decoder")) == (preset, spec.num_layers, rows, seq_len, loss, remat)
    assert record["tokens_per_s"] == pytest.approx(rows * seq_len / (record["ms"] / 1e3), rel=1e-9)
    assert record["flops_per_token"] == flops.flops_per_token(spec, seq_len)
    peak = flops.peak_tflops(record["device_kind"]) * 1e12
    assert record["mfu"] == pytest.approx(record["tokens_per_s"] * record["flops_per_token"] / peak, rel=1e-9)
    assert 0 < record["peak_hbm_gib"] < HBM_GIB[record["device_kind"]]
    assert record["compile_s"] > 0
    if remat == "fit":  # the first of FIT libtpu compiled, after one refusal per remat before it
        assert record["took"] in FIT and len(record["refused"]) == FIT.index(record["took"]), record


def test_fit_takes_projections_where_they_fit_and_decoder_where_libtpu_refuses_them():
    """``gradient_checkpointing: true`` on the chip (``step.fit``): Gemma 3 1B at 4 x 2048 tokens keeps the
    projections' products; at 8 x 2048 libtpu refuses them for the chip's HBM and the step takes decoder remat."""
    latest = {r["case"]: r for r in STEPS}
    assert latest["1b-26-fit"]["took"] == "projections"
    assert latest["1b-26-fit-8x2048"]["took"] == "decoder"
    assert "RESOURCE_EXHAUSTED" in latest["1b-26-fit-8x2048"]["refused"][0]


def test_a_rerun_loads_the_program_its_first_run_compiled_and_computes_the_same():
    """``--compile-cache`` (``run.compile_cache``, as ``gemport sft`` keeps its programs): a case run twice in one
    call, the second run loading what the first compiled (``cache_loaded``), took the same remat to the same
    compiled peak and reached the same loss after its steps, bit for bit."""
    reruns = [i for i, r in enumerate(RECORDS) if r.get("cache_loaded")]
    assert reruns
    for i in reruns:
        rerun, first = RECORDS[i], RECORDS[i - 1]
        assert first["case"] == rerun["case"] and first["cache_loaded"] == 0, (first, rerun)
        for field in ("took", "compiled_gib", "final_loss", "libtpu", "splash_blocks"):
            assert first[field] == rerun[field], field


def test_a_rerun_recalls_the_refusal_its_first_run_met_and_compiles_nothing_else():
    """Under "fit", a rerun of a case whose first remat libtpu refused (``cache_recalled``, ``run.compile_cache``)
    meets the same refusal, recalled from the cache rather than compiled, says so, and loads the rest."""
    reruns = [i for i, r in enumerate(RECORDS) if r.get("cache_recalled")]
    assert reruns
    for i in reruns:
        rerun, first = RECORDS[i], RECORDS[i - 1]
        assert first["case"] == rerun["case"] and first.get("cache_recalled") == 0, (first, rerun)
        assert rerun["cache_recalled"] == len(first["refused"]) == len(rerun["refused"]) and rerun["cache_loaded"]
        for was, again in zip(first["refused"], rerun["refused"]):
            assert again == f"{was} (recalled: the compile cache kept this program's refusal by an earlier compile)"


def program(r: dict) -> tuple:
    """What decides a step's compiled program besides the tree: its case, libtpu and splash attention's tiles (a
    record without them ran JAX's default tiles)."""
    return r["case"], r["libtpu"], json.dumps(r.get("splash_blocks"), sort_keys=True)


COMPILED_ONLY = {program(r): r["compiled_gib"]
                 for r in map(json.loads, (BENCH / "tpu_compiled.jsonl").read_text().splitlines())}
ON_CHIP_AND_HOST = [r for r in STEPS if program(r) in COMPILED_ONLY and "compiled_gib" in r]


def test_the_chips_compile_is_libtpus_compile_only_one():
    """The peak XLA compiled each step to on the chip (``compiled_gib``, its memory analysis) is the one libtpu
    compiles for one v5e on the CPU host (bench/tpu_compiled.jsonl, ``--compile-only``), to the byte: the host's
    compile-only figures, which the plan is judged against, are the chip's own."""
    assert ON_CHIP_AND_HOST
    for r in ON_CHIP_AND_HOST:
        assert r["compiled_gib"] * 2**30 == pytest.approx(COMPILED_ONLY[program(r)] * 2**30, abs=1), r


def test_the_headline_steps_latest_records_are_of_the_tiles_the_step_runs():
    """docs/benchmarks.md's figures are each case's latest record: for the headline cases, of the splash tiles the
    step runs today (``step.attention.SPLASH_BLOCKS``), so a change of tiles shows here until the bench reruns."""
    from gemport.step.attention import SPLASH_BLOCKS

    latest = {r["case"]: r for r in STEPS}
    for case in ("1b-26", "31b-4", "31b-5", "1b-26-projections", "31b-4-projections"):
        assert latest[case].get("splash_blocks") == SPLASH_BLOCKS, case


def test_the_steps_splash_tiles_are_the_recorded_fastest():
    """bench/splash.jsonl (``bench/bench_splash.py`` on the chip): every shape the bench runs, with every candidate
    tiling, each ratio to the default's tiles from the measured milliseconds; the tiles the step runs
    (``SPLASH_BLOCKS``) are a candidate, and over the shapes (geometric mean of the ratios) the fastest recorded."""
    import bench_splash

    from gemport.step.attention import SPLASH_BLOCKS

    splash = [json.loads(line) for line in (BENCH / "splash.jsonl").read_text().splitlines() if line.strip()]
    assert splash and all("TPU" in r["device_kind"] and r["libtpu"] for r in splash)
    assert {(r["shape"], r["tiling"]) for r in splash} == {(s, t) for s in bench_splash.SHAPES
                                                         for t in bench_splash.CANDIDATES}
    default = {r["shape"]: r["ms"] for r in splash if r["blocks"] is None}
    for r in splash:
        assert r["blocks"] == bench_splash.CANDIDATES[r["tiling"]]
        if "ms" in r:
            assert r["vs_default"] == pytest.approx(default[r["shape"]] / r["ms"], rel=1e-9)
    speedup = {t: np.exp(np.mean([np.log(r.get("vs_default", 0) or 1e-9) for r in splash if r["tiling"] == t]))
               for t in bench_splash.CANDIDATES}
    ours = next(t for t, blocks in bench_splash.CANDIDATES.items() if blocks == SPLASH_BLOCKS)
    assert max(speedup, key=speedup.get) == ours, speedup


def test_the_compile_profile_is_of_the_chips_compile_at_two_depths():
    """bench/compile_profile.jsonl (``tools/tpu/compile_profile.py`` on the chip): where libtpu's compile of the
    step goes (docs/tpu.md, "The compile on the chip, at two depths"). Each record is a case the bench runs,
    compiled for a TPU, its phases measured and its passes libtpu's, ranked by their CPU seconds; the two depths in
    one run of the same versions, so their difference is the layers' (read, not judged: rerun the tool on a TPU to
    renew them)."""
    profiles = [json.loads(line) for line in (BENCH / "compile_profile.jsonl").read_text().splitlines()]
    assert {r["case"] for r in profiles} >= {"1b-14", "1b-26"}
    for r in profiles:
        assert r["case"] in bench_tpu.CASES and "TPU" in r["target"] and r["libtpu"], r["case"]
        assert min(r["tracing_s"], r["lowering_s"], r["compiling_s"]) > 0
        seconds = [p["cpu_s"] for p in r["passes"]]
        assert seconds == sorted(seconds, reverse=True) and any(p["name"].startswith("XLA::TPU") for p in r["passes"])
    by_case = {r["case"]: r for r in profiles}
    shallow, deep = by_case["1b-14"], by_case["1b-26"]
    assert (shallow["libtpu"], shallow["date"]) == (deep["libtpu"], deep["date"])
    assert bench_tpu.spec_of(*bench_tpu.CASES["1b-14"][:2]).num_layers < bench_tpu.spec_of(
        *bench_tpu.CASES["1b-26"][:2]).num_layers
