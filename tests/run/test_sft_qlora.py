"""`gemport sft` on a QLoRA recipe: the 4-bit base the recipe's bitsandbytes fields ask for, trained as gemport's
Python QLoRA path trains it (tests/lora/test_qlora.py proves that path against TRL + bitsandbytes + PEFT).

The recipe YAML sets ``load_in_4bit``, ``bnb_4bit_quant_type: nf4``, ``use_bnb_nested_quant`` and ``dtype``.
``SFTRun.create`` on that YAML (what `gemport sft` runs, on one device here) loads a base equal to
``load_qlora_model``'s with double quantization, bitwise (and not the one without), and trains it with
HFPeftTrainer; ``step.train_step`` trains a copy of its step-0 model on the recipe's batches. Per-step loss and
grad_norm agree to float32 reordering, as tests/run/test_peft_trainer.py bounds HFPeftTrainer against train_step.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx

from gemport import SFTRun

from gemport.step import train_step
from gemport.checkpoint.quantize import load_qlora_model
from gemport.errors import LoraError
from gemport.lora import QLoraSpec
from gemport.mesh import make_mesh
from gemport.specs import GemmaSpec
from gemport import recipe
from quantized import dequantized
from lora_targets import TARGETS
from chats import chats, tokenizer

QLORA_FIELDS = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", use_bnb_nested_quant=True, dtype="float32")
RECIPE = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules=TARGETS,
              assistant_only_loss=True, packing=True, max_length=128, per_device_train_batch_size=2,
              gradient_accumulation_steps=2, max_steps=3, learning_rate=5e-3, weight_decay=0.1, max_grad_norm=0.5,
              lr_scheduler_type="cosine", warmup_steps=1, seed=3, save_strategy="no", bf16=False, **QLORA_FIELDS)


def test_gemport_sft_trains_a_qlora_recipe_as_the_python_path(qlora_base, tmp_path):
    path = qlora_base("gemma4")
    config = tmp_path / "sft.yaml"
    config.write_text(yaml.safe_dump(RECIPE))
    run = SFTRun.create(config, path, chats(8), tokenizer=tokenizer(), progress=False,
                        mesh=make_mesh(GemmaSpec.from_hf(path), fsdp=1, tp=1, devices=jax.devices()[:1]))
    got_base = dequantized(run.model)
    want = recipe.read(config).qlora()
    assert want == QLoraSpec(double_quant=True, compute_dtype="float32")
    nested, plain = (dequantized(load_qlora_model(path, q)) for q in (want, QLoraSpec(compute_dtype="float32")))
    assert got_base.keys() == nested.keys() and len(nested) > 0
    for key in nested:
        np.testing.assert_array_equal(got_base[key], nested[key], err_msg=key)
    assert any(not np.array_equal(got_base[k], plain[k]) for k in plain)

    # The same step-0 model for the Python path, in arrays of its own: the trainer's step donates the model's.
    graphdef, state = nnx.split(run.model)
    reference = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))
    logger = run.train().metrics_logger
    got = np.stack([logger.get_metric_history("", name, "train") for name in ("loss", "grad_norm")], axis=1)
    optimizer = nnx.Optimizer(reference, run.optimizer.tx, wrt=nnx.LoRAParam)
    step = train_step(wrt=nnx.LoRAParam)
    expected = np.array([[float(m.loss), float(m.grad_norm)]
                         for m in (step(reference, optimizer, batch) for batch in run.train_batches)])
    assert got.shape == expected.shape == (3, 2)
    np.testing.assert_allclose(got[:, 0], expected[:, 0], rtol=0, atol=1e-5)
    np.testing.assert_allclose(got[:, 1], expected[:, 1], rtol=1e-5, atol=0)


@pytest.mark.parametrize("fields, match", [
    ({"bnb_4bit_quant_type": "fp4"}, "bnb_4bit_quant_type='fp4'"),
    ({"dtype": "int8"}, "compute dtype 'int8'"),
], ids=["fp4", "compute-dtype"])
def test_a_qlora_recipe_gemport_cannot_reproduce_is_refused_naming_the_field(fields, match):
    with pytest.raises(LoraError, match=match):
        recipe.read({**RECIPE, **fields}).qlora()


def test_a_qlora_recipe_reads_as_trl_passes_it_to_bitsandbytes():
    r = recipe.read({**RECIPE, "dtype": "bfloat16", "use_bnb_nested_quant": False, "bnb_4bit_quant_storage": "uint8"})
    assert r.qlora() == QLoraSpec(double_quant=False, compute_dtype="bfloat16")
    assert [n.split(":")[0] for n in r.notes] == ["bnb_4bit_quant_storage='uint8'"]
    assert recipe.read({**RECIPE, "load_in_4bit": False}).qlora() is None
