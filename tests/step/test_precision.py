"""Products at the precision the recipe says: what ``step.precision`` sets, read from the program the run trains.

On CPU every float32 product is exact whatever the setting (the chip's effect is in tests/check/test_peers_on_chip.py);
here the lowered train step of ``HFPeftTrainer`` carries the recipe's precision on every ``dot_general``: float32
recipes ``HIGHEST``, ``tf32: true`` ``HIGH``, bfloat16 recipes ``DEFAULT``.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

from gemport.lora import LoraSpec
from gemport.mesh import make_mesh
from gemport.plan.compiled import lower_step, step_trainer
from gemport.run.model import lora_model
from gemport.specs import GemmaSpec
from gemport.step.precision import matmul_precision, with_precision


def test_the_recipe_gives_the_precision():
    assert matmul_precision(bf16=False, tf32=None) == "highest"
    assert matmul_precision(bf16=False, tf32=False) == "highest"
    assert matmul_precision(bf16=False, tf32=True) == "high"
    assert matmul_precision(bf16=True, tf32=None) == "default"
    assert matmul_precision(bf16=True, tf32=True) == "default"  # bfloat16 operands: one pass holds them


def test_with_precision_records_it_on_the_products_and_their_transposes():
    x = jnp.ones((4, 4), jnp.float32)

    def f(a):
        return (a @ a).sum()

    text = jax.jit(jax.grad(with_precision(f, "highest"))).lower(x).as_text()
    dots = re.findall(r"stablehlo\.dot_general.*", text)
    assert len(dots) == 2 and all("HIGHEST" in d for d in dots), dots  # the gradient: two transposed products
    assert with_precision(f, "default") is f


@pytest.mark.parametrize("fields, expected", [({"bf16": False}, "HIGHEST"), ({"bf16": False, "tf32": True}, "HIGH"),
                                              ({"bf16": True}, "DEFAULT")], ids=["float32", "tf32", "bfloat16"])
def test_the_trained_step_carries_the_recipe_precision(fields, expected):
    spec = dataclasses.replace(GemmaSpec.preset("gemma3-1b"), num_layers=2, hidden=64, mlp=128, num_heads=2,
                               num_kv_heads=1, head_dim=16, vocab=256, sliding_window=16,
                               layer_types=("sliding", "global"))
    dtype = jnp.bfloat16 if fields["bf16"] else jnp.float32
    model = lora_model(spec, LoraSpec(rank=4, alpha=8, targets=("q_proj", "down_proj")), param_dtype=dtype,
                       abstract=False)
    trainer = step_trainer(model, {**fields, "gradient_checkpointing": False})
    mesh = make_mesh(spec, fsdp=1, tp=1, devices=jax.devices()[:1])
    dots = re.findall(r"stablehlo\.dot_general.*", lower_step(trainer, mesh, 2, 32).as_text())
    assert dots and all(f"precision = [{expected}, {expected}]" in d for d in dots), dots[:3]
