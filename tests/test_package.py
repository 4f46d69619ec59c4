"""The public namespace: cheap to import, submodules on first use."""

import subprocess
import sys

import pytest

import gemport


def test_import_gemport_does_not_load_jax():
    code = "import sys, gemport; print('jax' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_submodules_load_on_first_use():
    assert gemport.specs.GemmaSpec.preset("gemma4-31b").num_layers == 60
    assert callable(gemport.checkpoint.load_hf) and callable(gemport.optim.from_hf)
    with pytest.raises(AttributeError, match="nonesuch"):
        gemport.nonesuch
