"""The suite's programs compile with LLVM at optimisation level 1 (conftest's ``PINNED_XLA_FLAGS``), for its time
budget: XLA's HLO passes and buffer assignment are untouched, and the machine code computes the same bits as at
XLA's default level, which users run. Level 0 does not (it leaves products and sums unfused, and the last bits
move), so it is not the pin."""

import os
import subprocess
import sys
from pathlib import Path

from conftest import LLVM_LEVEL

PROBE = Path(__file__).parent / "helpers" / "compile_probe.py"


def run(xla_flags: str) -> str:
    env = dict(os.environ, XLA_FLAGS=xla_flags, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, str(PROBE)], env=env, capture_output=True, text=True, check=True).stdout


def test_the_suites_llvm_level_computes_the_bits_of_the_default_level():
    suite = os.environ["XLA_FLAGS"]
    assert LLVM_LEVEL in suite.split()
    pinned = run(suite)
    assert len(pinned) > 1000
    assert pinned == run(suite.replace(LLVM_LEVEL, ""))
