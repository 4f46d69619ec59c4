"""What a recipe's fields build, without a model, for the recipe tests: ``sft`` (the fields over gemport's
defaults and ``BASE``), its ``examples`` of ``DATA``, HF's order of batches (``steps``), the run's ``outputs`` and its
``lora``."""

import types

from chats import chats, tokenizer
from tiny import text_config

from gemport import recipe
from gemport.data.sft import from_sft_config
from gemport.lora import LoraSpec
from gemport.run.sft import training_config

TOK = tokenizer()
DATA = chats(12)
BASE = dict(assistant_only_loss=True, max_length=128, per_device_train_batch_size=2, max_steps=4, seed=3)


def sft(**fields):
    return {**recipe.read({}).sft, **BASE, **fields}


def examples(records=DATA, **fields):
    pipeline = from_sft_config(sft(**fields), TOK)
    return pipeline.examples(records, TOK, progress=False, check=None)


def steps(**fields):
    """[(micro-batch index lists...)], [batch] of HF's order for ``fields``."""
    pipeline = from_sft_config(sft(**fields), TOK)
    out = list(pipeline.batches(examples(**fields)[0]))
    return [tuple(tuple(int(i) for i in m) for m in s.micro_batches) for s, _ in out], [b for _, b in out]


def outputs(tmp_path, **fields):
    """``HFOutputs`` of a run of ``fields`` (its plan, batches and cadence; no model), started."""
    from gemport.run.outputs import HFOutputs, step_epochs, step_tokens

    args = sft(**fields)
    order, batches = steps(**fields)
    plan = list(from_sft_config(args, TOK).batches(examples(**fields)[0]))
    base = tmp_path / "base"
    if not base.is_dir():  # the run config trackers upload reads the base's config.json
        text_config("gemma3_1b").save_pretrained(base)
    hooks = HFOutputs(tmp_path, args, epochs=step_epochs([s for s, _ in plan], len(examples(**fields)[0]), args),
                      tokens=step_tokens(batches), learning_rate=None,
                      eval_every=training_config(args, len(plan), evaluate=True).eval_every_n_steps,
                      tracker_config=dict(base_dir=base, lora_config=lora().to_peft(str(base)), num_parameters=0))
    hooks._begin(types.SimpleNamespace(train_steps=0))
    return hooks


def lora(**fields):
    return LoraSpec.from_peft(recipe.read({"use_peft": True, "lora_target_modules": ["q_proj"], **fields}).lora())
