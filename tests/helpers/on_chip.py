"""The TPU tier's shared pieces: the chip, the CPU beside it, distances, floors and the record of each run.

Each on-chip comparison is judged against a floor measured in the same run and appended, with the device and
versions, to the JSON lines file ``$GEMPORT_TPU_RECORD`` (the device run copies it to ``RECORD``, which
tests/test_on_chip_record.py checks on every machine).
"""

import importlib.metadata
import json
import os

import jax
import numpy as np
from repo_paths import FILES

RECORD = FILES / "on_chip.jsonl"
"""The figures of the last run of the tier on a TPU, as recorded in the repository."""

ATTENTION_LAYERS = {  # heads per row fewer than the models', widths, windows and query groups as theirs
    "gemma3-sliding": dict(heads=4, kv_heads=1, head_dim=256, window=512),
    "gemma3-global": dict(heads=4, kv_heads=1, head_dim=256, window=None),
    "gemma4-sliding": dict(heads=8, kv_heads=4, head_dim=256, window=1024),
    "gemma4-global-k_eq_v": dict(heads=8, kv_heads=1, head_dim=512, window=None, k_eq_v=True),
}
"""The attention layers of Gemma 3 and Gemma 4 the tier compares splash attention on."""

DTYPES = ("bfloat16", "float32")
"""The recipes' dtypes the tier compares in."""

TESTS = ("splash_attention", "chunked_loss", "lora_dropout", "verify", "parity", "trained_step")
"""What the tier records (``record``'s ``test``), each at least once: the step tier's, then the check tier's
(tests/check/test_peers_on_chip.py, with the peers)."""

GAPS = {"base logits float32"}
"""The tier's comparisons the recorded run did not hold on the chip (issue 45, open; docs/tpu.md). ``verify``'s
float32 logits: what remains once RoPE's angles and the custom backward passes' precision were fixed ("Precision").
The record test requires each to be beyond its bound, so one that holds in a renewed record fails it until it leaves
this set."""

MULTIPLE = 10.0
"""A comparison passes at up to this many times its floor (the suite's and ``gemport parity``'s multiple)."""


def chip() -> jax.Device:
    """The TPU device (the tier runs where there is one)."""
    return next(d for d in jax.devices() if d.platform == "tpu")


def cpu() -> jax.Device:
    """The host's CPU device, beside the chip."""
    return jax.devices("cpu")[0]


def on(device: jax.Device, tree):
    """``tree``'s arrays placed on ``device``."""
    return jax.device_put(tree, device)


def relative(got, want) -> float:
    """max |got - want| over max |want| (float64; 0 for equal arrays)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = np.abs(want).max()
    return float(np.abs(got - want).max() / scale) if scale else float(np.abs(got - want).max())


def versions() -> dict:
    """The device kind, the versions and splash attention's tiles: what decides what the chip computes."""
    from gemport.step.attention import SPLASH_BLOCKS

    out = {"device_kind": chip().device_kind, "jax": jax.__version__, "splash_blocks": SPLASH_BLOCKS}
    for package in ("jaxlib", "libtpu", "google-tunix", "qwix", "torch", "trl", "peft", "transformers"):
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def record(test: str, case: str, worst: float, floor: float, bound: float, **extra) -> None:
    """Append one comparison to ``$GEMPORT_TPU_RECORD``: its worst distance, its floor and its bound."""
    path = os.environ.get("GEMPORT_TPU_RECORD")
    line = {"test": test, "case": case, "worst": worst, "floor": floor, "bound": bound, "ok": worst <= bound,
            **extra, **versions()}
    print(json.dumps(line))
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


def judged(test: str, case: str, worst: float, floor: float, least: float, **extra) -> bool:
    """Record ``worst`` against ``MULTIPLE`` x ``floor`` (at least ``least``, the rounding of the result the
    arithmetic gives) and return whether it holds (a test asserts all of its verdicts, so each is recorded)."""
    bound = MULTIPLE * max(floor, least)
    record(test, case, worst, floor, bound, least=least, **extra)
    if worst > bound:
        print(f"{case}: {worst:.3g} > {bound:.3g} ({MULTIPLE:g} x the floor {max(floor, least):.3g})")
    return worst <= bound
