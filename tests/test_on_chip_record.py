"""The TPU tier's last run on a chip, as recorded in tests/files/on_chip.jsonl: every comparison the tier makes is
there, from a TPU, each within its bound (but the gaps issue 45 has open, each beyond it), and each bound
``on_chip.MULTIPLE`` times a floor measured in that run (at least the dtype's rounding). Rerun the tier on a TPU
host to renew it (docs/tpu.md, "The TPU tier of the suite")."""

import json

import pytest
from on_chip import ATTENTION_LAYERS, DTYPES, GAPS, MULTIPLE, RECORD, TESTS

from gemport.step.attention import SPLASH_BLOCKS


@pytest.fixture(scope="module")
def records():
    assert RECORD.is_file(), f"{RECORD}: no record of the TPU tier; run it on a TPU host"
    return [json.loads(line) for line in RECORD.read_text().splitlines() if line.strip()]


def test_the_record_is_of_a_tpu_and_holds_every_comparison(records):
    assert {r["device_kind"] for r in records} and all("TPU" in r["device_kind"] for r in records)
    assert set(TESTS) <= {r["test"] for r in records}
    splash = {(r["layer"], r["dtype"], r["quantity"]) for r in records if r["test"] == "splash_attention"}
    assert splash >= {(layer, dtype, q) for layer in ATTENTION_LAYERS for dtype in DTYPES
                      for q in ("out", "dq", "dk", "dv")}


def test_the_record_shows_a_broken_port_failing_on_the_chip(records):
    """``gemport parity`` on the chip refuses a port whose learning rate is not the recipe's."""
    assert any(r["test"] == "parity" and r.get("expect") == "fail" for r in records)


def test_every_comparison_holds_its_bound_from_its_floor(records):
    for r in records:
        if "least" in r:  # judged against a multiple of its floor
            assert r["bound"] == pytest.approx(MULTIPLE * max(r["floor"], r["least"])), r["case"]
        if r.get("expect") == "fail":  # a broken port, which the comparison must refuse
            assert r["ok"] and r["worst"] > r["bound"], r
        elif r["case"] in GAPS:  # open: recorded as it failed, until a renewed record holds it
            assert not r["ok"] and r["worst"] > r["bound"], f"{r['case']} holds now: take it out of GAPS"
        else:
            assert r["ok"] and r["worst"] <= r["bound"], r


def test_the_record_is_of_the_splash_tiles_the_step_runs(records):
    """The tier's comparisons of splash attention, and of the steps that run it, are of the tiles the step runs
    (``step.attention.SPLASH_BLOCKS``; a record without the field ran JAX's default tiles)."""
    runs = {json.dumps(r.get("splash_blocks"), sort_keys=True) for r in records
            if r["test"] in ("splash_attention", "trained_step", "parity")}
    assert runs == {json.dumps(SPLASH_BLOCKS, sort_keys=True)}


def test_the_bfloat16_steps_floor_is_trls_or_its_own_spread_across_tiles(records):
    """The bfloat16 step's floor per quantity: the larger of TRL's float32-vs-bfloat16 spread and the CPU step's own
    across attention tiles, both measured in the run (tests/check/test_peers_on_chip.py)."""
    steps = [r for r in records if r["test"] == "trained_step" and r["dtype"] == "bfloat16"]
    assert {r["step"] for r in steps} == {0, 1} and {r["quantity"] for r in steps} == {"loss", "grad_norm"}
    for r in steps:
        assert r["floor"] == max(r["trl_floor"], r["tiles_spread"]) and r["tiles_spread"] > 0, r
