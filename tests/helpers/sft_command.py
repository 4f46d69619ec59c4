"""``gemport sft --config`` on the tiny Gemma 4 of the ``sft_workdir`` fixture (tests/conftest.py): the recipe's
fields (``RECIPE``), and ``write_recipe``, which writes them as a recipe file on the workdir's base and data."""

import yaml

RECIPE = dict(assistant_only_loss=True, max_length=128, per_device_train_batch_size=2, gradient_accumulation_steps=2,
              max_steps=4, learning_rate=5e-3, weight_decay=0.1, max_grad_norm=0.5, lr_scheduler_type="cosine",
              warmup_steps=1, seed=3, logging_steps=1, eval_strategy="steps", eval_steps=3,
              per_device_eval_batch_size=2, bf16=False, dataloader_num_workers=2)


def write_recipe(path, root, **fields):
    path.write_text(yaml.safe_dump({"model_name_or_path": str(root / "base"), "dataset_name": str(root / "data"),
                                    **RECIPE, **fields}))
    return path
