"""The runnable examples in the docstrings of the main entry points run and print what they say."""

import doctest
import importlib

import pytest

MODULES = ["gemport.recipe", "gemport.optim.hf", "gemport.train.order"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    failed, attempted = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert attempted, f"{name} has no example"
    assert not failed
