"""hf_optimizer reads TrainingArguments and plain dicts alike, and refuses what it cannot reproduce."""

import dataclasses
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from transformers import TrainingArguments

from gemport.errors import GemportError, OptimizerConfigError
from gemport.optim import hf_optimizer
from gemport.recipe import DEFAULT_ONLY, RETIRED, OptimizerFields

STEPS = 30


def training_args(tmp_path, **fields):
    return TrainingArguments(output_dir=str(tmp_path), **fields)


def run(tx, steps=STEPS):
    """A few steps on a tree holding a decayed weight and an excluded norm, with small gradients."""
    params = {"layer.weight": jnp.linspace(-1.0, 1.0, 8), "layer.norm.weight": jnp.ones(8)}
    rng = np.random.default_rng(0)
    state = tx.init(params)
    for _ in range(steps):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape) * 1e-7, jnp.float32), params)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params


def test_the_fields_read_are_training_arguments_fields():
    """Each field hf_optimizer reads is a TrainingArguments field (or one older transformers had), so its default is
    transformers' own (gemport.recipe.OptimizerFields), never a copy."""
    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    assert set(OptimizerFields.names()) - set(RETIRED) <= fields and set(DEFAULT_ONLY) <= fields


def test_an_empty_dict_is_default_training_arguments(tmp_path):
    from_dict = hf_optimizer({}, num_training_steps=STEPS)
    from_args = hf_optimizer(training_args(tmp_path), num_training_steps=STEPS)
    np.testing.assert_array_equal(from_dict.schedule(jnp.arange(STEPS)), from_args.schedule(jnp.arange(STEPS)))
    jax.tree.map(np.testing.assert_array_equal, run(from_dict.tx), run(from_args.tx))


RECIPE = dict(
    learning_rate=2e-4,
    weight_decay=0.01,
    adam_beta1=0.8,
    adam_beta2=0.95,
    adam_epsilon=1e-6,
    max_grad_norm=0.3,
    lr_scheduler_type="cosine_with_restarts",
    lr_scheduler_kwargs={"num_cycles": 2},
    warmup_steps=0.1,
    optim="adamw_torch",
)


def test_a_dict_of_fields_is_the_same_training_arguments(tmp_path):
    from_dict = hf_optimizer(RECIPE, num_training_steps=STEPS)
    from_args = hf_optimizer(training_args(tmp_path, **RECIPE), num_training_steps=STEPS)
    np.testing.assert_array_equal(from_dict.schedule(jnp.arange(STEPS)), from_args.schedule(jnp.arange(STEPS)))
    jax.tree.map(np.testing.assert_array_equal, run(from_dict.tx), run(from_args.tx))
    assert float(from_dict.schedule(2)) == pytest.approx(2e-4 * 2 / 3)  # ceil(0.1 * 30) = 3 warmup steps
    # Every field counts: the recipe differs from the defaults in its result.
    default = run(hf_optimizer({}, num_training_steps=STEPS).tx)
    assert not np.allclose(run(from_dict.tx)["layer.weight"], default["layer.weight"])


def test_accumulation_is_carried_not_folded_into_the_step():
    single = hf_optimizer(RECIPE, num_training_steps=STEPS)
    accumulating = hf_optimizer(dict(RECIPE, gradient_accumulation_steps=4), num_training_steps=STEPS)
    assert (single.accumulation, accumulating.accumulation) == (1, 4)
    # One optimizer step per accumulated batch whatever A is: train_step and PeftTrainer take either tx.
    jax.tree.map(np.testing.assert_array_equal, run(single.tx), run(accumulating.tx))
    params = {"layer.weight": jnp.ones(4)}
    per_micro_batch = hf_optimizer({"lr_scheduler_type": "constant", "gradient_accumulation_steps": 4},
                                   num_training_steps=STEPS).per_micro_batch
    state = per_micro_batch.init(params)
    for _ in range(3):
        held, state = per_micro_batch.update(params, state, params, num_tokens=2)
        np.testing.assert_array_equal(held["layer.weight"], 0.0)
    stepped, _ = per_micro_batch.update(params, state, params, num_tokens=2)
    assert np.all(np.asarray(stepped["layer.weight"]) != 0.0)


def test_warmup_ratio_of_older_recipes_is_a_fractional_warmup_steps():
    # transformers 5.15 removed warmup_ratio (warmup_steps below 1 is the ratio): recipes of both generations read.
    older = dict(RECIPE, warmup_steps=7, warmup_ratio=0.1)
    schedules = [hf_optimizer(fields, num_training_steps=STEPS).schedule(jnp.arange(STEPS)) for fields in (older, RECIPE)]
    np.testing.assert_array_equal(*schedules)
    assert not np.array_equal(schedules[0], hf_optimizer(dict(RECIPE, warmup_steps=7), num_training_steps=STEPS)
                              .schedule(jnp.arange(STEPS)))


@pytest.mark.skipif("warmup_ratio" not in {f.name for f in dataclasses.fields(TrainingArguments)},
                    reason="this transformers has no TrainingArguments.warmup_ratio (removed in 5.15)")
def test_training_arguments_warmup_ratio_where_transformers_has_it(tmp_path):
    ratio = hf_optimizer(training_args(tmp_path, warmup_ratio=0.1), num_training_steps=STEPS)
    steps = hf_optimizer(training_args(tmp_path, warmup_steps=0.1), num_training_steps=STEPS)
    np.testing.assert_array_equal(ratio.schedule(jnp.arange(STEPS)), steps.schedule(jnp.arange(STEPS)))


def test_weight_decay_spares_norms():
    recipe = {"weight_decay": 0.5, "learning_rate": 0.1, "lr_scheduler_type": "constant"}
    tx = hf_optimizer(recipe, num_training_steps=STEPS).tx
    params = {"layer.weight": jnp.ones(4), "layer.norm.weight": jnp.ones(4)}
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    np.testing.assert_allclose(optax.apply_updates(params, updates)["layer.weight"], 1 - 0.1 * 0.5, rtol=1e-6)
    np.testing.assert_array_equal(optax.apply_updates(params, updates)["layer.norm.weight"], 1.0)


def test_params_fix_the_mask_now():
    params = {"layer.weight": jnp.ones(8), "layer.norm.weight": jnp.ones(8)}
    eager = hf_optimizer({"weight_decay": 0.1}, num_training_steps=STEPS, params=params).tx
    lazy = hf_optimizer({"weight_decay": 0.1}, num_training_steps=STEPS).tx
    jax.tree.map(np.testing.assert_array_equal, run(eager), run(lazy))
    with pytest.raises(OptimizerConfigError, match="omit params"):
        eager.init({"other.weight": jnp.ones(8)})
    lazy.init({"other.weight": jnp.ones(8)})


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"optim": "adafactor"}, "adafactor.*adamw_torch"),
        ({"optim": "sgd"}, "sgd.*adamw_torch_fused"),
        ({"lr_scheduler_type": "inverse_sqrt"}, "inverse_sqrt"),
        ({"lr_scheduler_kwargs": {"num_cycles": 2}}, "num_cycles.*linear"),
        ({"lr_scheduler_kwargs": "num_cycles=2"}, "dict"),
        ({"optim_args": "foo=1"}, "optim_args"),
        ({"optim_target_modules": ["q_proj"]}, "optim_target_modules"),
        ({"deepspeed": "ds.json"}, "deepspeed"),
        ({"average_tokens_across_devices": False}, "average_tokens_across_devices"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"learning_rate": "2e-4"}, "learning_rate must be a number.*'2e-4'"),
        ({"warmup_ratio": "0.1"}, "warmup_ratio must be a number"),
    ],
)
def test_what_it_cannot_reproduce_is_an_error(fields, match):
    with pytest.raises(OptimizerConfigError, match=match) as error:
        hf_optimizer(fields, num_training_steps=STEPS)
    assert isinstance(error.value, GemportError)


def test_a_trl_sft_config_is_read_with_its_own_defaults(tmp_path):
    trl = pytest.importorskip("trl")
    config = trl.SFTConfig(output_dir=str(tmp_path), bf16=False, lr_scheduler_type="constant")
    assert float(hf_optimizer(config, num_training_steps=STEPS).schedule(0)) == np.float32(2e-5)


def test_enum_fields_of_training_arguments_are_read(tmp_path):
    args = training_args(tmp_path, optim="sgd")
    with pytest.raises(OptimizerConfigError, match="'sgd'"):
        hf_optimizer(args, num_training_steps=STEPS)


def test_importing_gemport_optim_needs_neither_torch_nor_transformers():
    code = "import sys, gemport.optim; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
