"""The runnable examples in the docstrings of the main entry points run and print what they say. Examples that
need a checkpoint get ``checkpoint``: a tiny Gemma 3 saved by transformers (``hf_checkpoint("gemma3_1b")``); those
that need a tokenizer get ``tokenizer``: one token per character, with Gemma 4's control tokens and its training
chat template."""

import doctest
import importlib

import pytest
from tiny_tokenizers import GEMMA4_CONTROL, char_tokenizer

from gemport.data.training_template import gemma4_training_template

MODULES = ["gemport.recipe", "gemport.optim.hf", "gemport.data.order", "gemport.specs.spec",
           "gemport.checkpoint.load", "gemport.lora.qwix", "gemport.plan.memory", "gemport.mesh.factory",
           "gemport.check.verify", "gemport.lora.layout", "gemport.mesh.audit", "gemport.checkpoint.adapters",
           "gemport.checkpoint.peft_io", "gemport.checkpoint.orbax", "gemport.run.trainer",
           "gemport.data.sft", "gemport.step.fit"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name, hf_checkpoint):
    module = importlib.import_module(name)
    tokenizer = char_tokenizer(GEMMA4_CONTROL)
    tokenizer.chat_template = gemma4_training_template()
    extraglobs = {"checkpoint": str(hf_checkpoint("gemma3_1b")[1]), "tokenizer": tokenizer}
    failed, attempted = doctest.testmod(module, extraglobs=extraglobs,
                                        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert attempted, f"{name} has no example"
    assert not failed
