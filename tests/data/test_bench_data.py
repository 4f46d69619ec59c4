"""The training-data benchmark's recorded figures (bench/data_scale.jsonl, written by ``bench/bench_data.py
--record``) and what docs/benchmarks.md says of them. Nothing is timed here: the recorded figures are read, their
shape checked, the docs' tables compared with them and the docs' claims held to them."""

import json
import sys

import pytest
from repo_paths import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import bench_data  # noqa: E402

RECORDS = [json.loads(line) for line in (ROOT / "bench" / "data_scale.jsonl").read_text().splitlines() if line]
DOCS = (ROOT / "docs" / "benchmarks.md").read_text()
SIZES = [10_000, 100_000, 1_000_000]
CHIP_TOKENS_PER_S = 11_000  # Gemma 3 1B's train step on one v5e chip today, as the docs compare


def by_size(n):
    return next(r for r in RECORDS if r["n"] == n)


def test_every_size_is_recorded_with_every_figure():
    assert sorted(r["n"] for r in RECORDS) == SIZES
    for r in RECORDS:
        for side in ("gemport_cold", "gemport_cached"):
            figures = r[side]
            assert figures["tokens"] > 0 and figures["first_step_s"] > 0 and figures["prepare_s"] > 0
            assert figures["rss_mib"]["self"] > 0 and figures["examples"] > 0 and figures["rows"] > 0
        assert r["gemport_cold"]["tokens"] == r["gemport_cached"]["tokens"]  # the cache holds what was prepared
        assert r["gemport_cached"]["loader_tokens_per_s"] > 0
        assert ("trl_cold" in r) == ("trl_cached" in r) == (r["n"] <= 100_000)
        for side in ("trl_cold", "trl_cached"):
            if side in r:
                assert r[side]["first_step_s"] > 0 and r[side]["tokens"] > 0 and r[side]["rss_mib"]["self"] > 0


def test_the_docs_tables_are_the_recorded_figures():
    assert bench_data.table(sorted(RECORDS, key=lambda r: r["n"])) in DOCS


@pytest.mark.parametrize("claim", ["cached first step under 10 s at 1M", "cold at least TRL's speed",
                                   "peak RSS flat", "loader far ahead of the chip"])
def test_the_docs_claims_hold_in_the_records(claim):
    million = by_size(1_000_000)
    if claim == "cached first step under 10 s at 1M":
        assert "first step of a cached 1M run in under 10 seconds: met" in DOCS
        assert million["gemport_cached"]["first_step_s"] < 10
    elif claim == "cold at least TRL's speed":
        assert "cold preparation at least as fast as TRL's with the same number of processes: met" in DOCS
        for r in RECORDS:
            if "trl_cold" in r:
                ours, theirs = r["gemport_cold"], r["trl_cold"]
                assert ours["tokens"] / ours["prepare_s"] >= theirs["tokens"] / theirs["prepare_s"]
                assert ours["first_step_s"] <= theirs["first_step_s"]
    elif claim == "peak RSS flat":
        assert "flat within 300 MiB" in DOCS
        cached = [r["gemport_cached"]["rss_mib"]["self"] for r in RECORDS]
        assert max(cached) - min(cached) < 300
    else:
        assert "over a thousand times" in DOCS
        assert all(r["gemport_cached"]["loader_tokens_per_s"] > 1000 * CHIP_TOKENS_PER_S for r in RECORDS)
