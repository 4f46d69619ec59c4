"""``gemport dpo --config`` on the tiny Gemma 3 of the ``dpo_workdir`` fixture (tests/conftest.py):
``write_recipe`` writes a recipe file on the workdir's base and data."""

import yaml


def write_recipe(path, root, **fields):
    path.write_text(yaml.safe_dump({"model_name_or_path": str(root / "base"), "dataset_name": str(root / "data"),
                                    **fields}))
    return path
