"""The HF/TRL boundary: the one table of the fields gemport reads (``fields``) and the one reader (``read``).

A recipe (a ``trl sft`` / ``trl dpo`` YAML, a dict of its fields, an ``SFTConfig`` / ``DPOConfig`` /
``TrainingArguments``) enters gemport here and nowhere else: ``read`` accounts for every field it sets (used,
mapped with a note, or refused with a ``RecipeError``), ``trainer_fields`` gives every trainer-config field of it,
and each consumer takes its group of fields as a typed value (``OptimizerFields`` for ``optim.hf_optimizer``,
``OrderFields`` for ``data.optimizer_steps``, ``DataFields`` for ``data.from_sft_config``, ``RunFields`` for
``run.SFTRun`` and ``run.DPORun``, ``OutputsFields`` for ``run.outputs``, ``PreferenceFields`` for
``run.DPORun``'s pairs, ``DPOLossFields`` for ``step.from_dpo_config``; ``parity`` and the command lines take a whole ``Recipe``), each absent field at its
owner's default, read from TRL or transformers (never written down in gemport).

Example::

    >>> from gemport import recipe
    >>> r = recipe.read({"learning_rate": 2e-4, "use_peft": True, "lora_r": 8})
    >>> r.sft["learning_rate"], r.sft["per_device_train_batch_size"], r.lora()["r"]
    (0.0002, 8, 8)
    >>> recipe.OrderFields.from_config({"max_steps": 3}).num_train_epochs
    3.0

This package sits low: it imports ``gemport.errors``, the standard library, PyYAML and (lazily) TRL and
transformers; everything that reads a recipe imports it.
"""

from gemport.recipe.fields import (COMMANDS, DEFAULT_ONLY, DPO, DPO_MAPPED, MAPPED, MODEL, QLORA,
                                   REFUSED_WHEN_SET, RETIRED, SCRIPT, SFT, STRATEGIES, TRL_LORA, USED, DataFields,
                                   DPOLossFields, Fields, OptimizerFields, OrderFields, OutputsFields,
                                   PreferenceFields, RunFields,
                                   given)
from gemport.recipe.owners import OWNERS, class_defaults, defaults, owner_class
from gemport.recipe.read import Recipe, check_strategies, parse_overrides, read, trainer_fields

__all__ = ["COMMANDS", "DEFAULT_ONLY", "DPO", "DPO_MAPPED", "MAPPED", "MODEL", "OWNERS", "QLORA", "REFUSED_WHEN_SET",
           "RETIRED", "SCRIPT", "SFT", "STRATEGIES", "TRL_LORA", "USED", "DataFields", "DPOLossFields", "Fields",
           "OptimizerFields", "OrderFields", "OutputsFields", "PreferenceFields", "Recipe", "RunFields", "check_strategies",
           "class_defaults", "defaults", "given", "owner_class", "parse_overrides", "read", "trainer_fields"]
