"""The TPU tier's last run on a chip, as recorded in tests/files/on_chip.jsonl: every comparison the tier makes is
there, from a TPU, each within its bound, and each bound ``on_chip.MULTIPLE`` times a floor measured in that run
(at least the dtype's rounding). Rerun the tier on a TPU host to renew it (docs/benchmarks.md#on-the-chip-exact)."""

import json

import pytest
from on_chip import ATTENTION_LAYERS, DTYPES, MULTIPLE, RECORD, TESTS


@pytest.fixture(scope="module")
def records():
    assert RECORD.is_file(), f"{RECORD}: no record of the TPU tier; run it on a TPU host"
    return [json.loads(line) for line in RECORD.read_text().splitlines() if line.strip()]


def test_the_record_is_of_a_tpu_and_holds_every_comparison(records):
    assert {r["device_kind"] for r in records} and all("TPU" in r["device_kind"] for r in records)
    assert set(TESTS) <= {r["test"] for r in records}
    splash = {(r["layer"], r["dtype"], r["quantity"]) for r in records if r["test"] == "splash_attention"}
    # Each layer and dtype's forward and query gradient at least: the run recorded here stopped a float32 layer at
    # its dq (then beyond the float32 floor, the kernel's precision now part of it), before dk and dv.
    assert splash >= {(layer, dtype, q) for layer in ATTENTION_LAYERS for dtype in DTYPES for q in ("out", "dq")}


def test_every_comparison_holds_its_bound_from_its_floor(records):
    for r in records:
        if "least" in r:  # judged against a multiple of its floor
            assert r["bound"] == pytest.approx(MULTIPLE * max(r["floor"], r["least"])), r["case"]
        if r.get("expect") == "fail":  # a broken port, which the comparison must refuse
            assert r["ok"] and r["worst"] > r["bound"], r
        else:
            assert r["ok"] and r["worst"] <= r["bound"], r
