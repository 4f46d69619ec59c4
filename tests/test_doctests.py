"""The runnable examples in the docstrings of the main entry points run and print what they say. Examples that
need a checkpoint get ``checkpoint``: a tiny Gemma 3 saved by transformers (``hf_checkpoint("gemma3_1b")``)."""

import doctest
import importlib

import pytest

MODULES = ["gemport.recipe", "gemport.optim.hf", "gemport.train.order", "gemport.specs.spec",
           "gemport.checkpoint.load", "gemport.lora.qwix", "gemport.plan.memory", "gemport.mesh.factory",
           "gemport.verify", "gemport.lora.layout", "gemport.sharding.audit",
           "gemport.checkpoint.adapters", "gemport.train.peft_trainer"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name, hf_checkpoint):
    module = importlib.import_module(name)
    extraglobs = {"checkpoint": str(hf_checkpoint("gemma3_1b")[1])}
    failed, attempted = doctest.testmod(module, extraglobs=extraglobs,
                                        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert attempted, f"{name} has no example"
    assert not failed
