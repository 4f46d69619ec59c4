"""The public namespace: cheap to import, submodules on first use."""

import subprocess
import sys

import pytest

import gemport


def test_import_gemport_does_not_load_jax_and_submodules_load_on_first_use():
    code = ("import sys, gemport; print('jax' in sys.modules, 'gemport.specs' in sys.modules, "
            "gemport.specs.GemmaSpec.preset('gemma4-31b').num_layers, 'gemport.specs' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.split()
    assert out == ["False", "False", "60", "True"]


def test_an_unknown_name_is_an_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="nonesuch"):
        gemport.nonesuch


def test_planning_and_configs_load_without_qwix():
    code = "import sys, gemport.mesh, gemport.lora; print('qwix' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
