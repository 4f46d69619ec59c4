"""from_sft_config: one SFTConfig drives TRL's SFTTrainer and the port alike (masks, packing, order, steps)."""

import datasets
import jax
import peft
import pytest
import torch
import transformers
from flax import nnx
from float64 import relative, trajectory_bound
from trl import SFTConfig, SFTTrainer

from gemport.data import from_sft_config, Gemma4, MaskPolicy

from gemport.step import train_step
from gemport.checkpoint import import_peft, load_model
from gemport.errors import RecipeError
from gemport.lora import apply_lora
from gemport.optim import hf_optimizer
from gemport.specs import GemmaSpec
from chats import chats, tokenizer
from sft_recipe import CONFIG, float64_logs


def test_config_maps_onto_the_masks_pipeline():
    t = tokenizer()
    pipeline = from_sft_config(SFTConfig(output_dir="unused", **CONFIG), t)
    assert isinstance(pipeline.chat_format, Gemma4) and pipeline.policy == MaskPolicy("assistant")
    assert (pipeline.layout, pipeline.truncation.max_len, pipeline.pad_id) == ("pack", 128, t.pad_token_id)
    assert from_sft_config({"padding_free": True}, t).layout == "padding_free"
    plain = from_sft_config({"max_length": None, "pad_to_multiple_of": 8}, t)
    assert (plain.layout, plain.policy, plain.pad_to_multiple_of) == ("pad", None, 8)
    # TRL's SFTConfig checkpoints gradients by default; the port recomputes each decoder layer.
    assert pipeline.remat == "decoder" and plain.remat == "decoder"
    assert from_sft_config({"gradient_checkpointing": False}, t).remat == "none"
    # torch's use_reentrant has no JAX counterpart and changes nothing; any other key is refused by name
    assert from_sft_config({"gradient_checkpointing_kwargs": {"use_reentrant": False}}, t).remat == "decoder"
    with pytest.raises(RecipeError, match=r"gradient_checkpointing_kwargs\['preserve_rng_state'\]"):
        from_sft_config({"gradient_checkpointing_kwargs": {"preserve_rng_state": True}}, t)
    for bad, field in [({"truncation_mode": "keep_end"}, "truncation_mode"), ({"loss_type": "dft"}, "loss_type"),
                       ({"packing": True, "packing_strategy": "wrapped"}, "packing_strategy"),
                       ({"shuffle_dataset": True}, "shuffle_dataset"), ({"packing": True, "max_length": None}, "max_length")]:
        with pytest.raises(RecipeError, match=field):
            from_sft_config(bad, t)


@pytest.mark.parametrize("layout", [{}, {"packing": False}, {"packing": False, "padding_free": True}])
def test_batches_have_one_shape_and_hold_every_target(layout):
    config = {**CONFIG, **layout, "max_steps": 6}
    pipeline = from_sft_config(config, tokenizer())
    examples, _ = pipeline.examples(chats(), tokenizer(), progress=False)
    shapes, targets = set(), 0
    for _, batch in pipeline.batches(examples):
        shapes.add(batch["tokens"].shape)
        targets += int(batch["loss_mask"].sum())
    assert len(shapes) == 1
    # 6 steps of 2 x 2 units visit each unit of an epoch once, the last epoch partly.
    assert targets > sum(int(e.loss_mask.sum()) for e in examples)


# The 31B layout; E2B's and E4B's (per-layer inputs, KV-shared layers) train through `gemport sft` against the same
# TRL runs in tests/run/test_gemma4_e2e.py.
def test_packed_run_matches_trl(hf_checkpoint, tmp_path):
    """TRL SFTTrainer + PEFT (assistant-only loss, BFD packing, padding-free) and the port from one SFTConfig."""
    _, base = hf_checkpoint("gemma4_mesh")
    args = SFTConfig(output_dir=str(tmp_path / "trl"), **CONFIG)
    data = datasets.Dataset.from_list(chats())
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    model.save_pretrained(tmp_path / "adapter0")
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer())
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    exact = float64_logs(base, tmp_path, data)

    pipeline = from_sft_config(args, tokenizer())
    examples, report = pipeline.examples(data, tokenizer(), progress=False)
    rows = pipeline.units(examples)
    expected_rows = [r for r in trainer.train_dataset["input_ids"]]
    assert [r[s > 0].tolist() for r, s in zip(rows["tokens"], rows["segment_ids"])] == expected_rows

    spec = GemmaSpec.from_hf(base)
    port = apply_lora(load_model(base), spec, import_peft(tmp_path / "adapter0", base_dir=base))
    hf = hf_optimizer(args, num_training_steps=args.max_steps)
    optimizer = nnx.Optimizer(port, hf.tx, wrt=nnx.LoRAParam)
    step = train_step()
    metrics = [jax.device_get(step(port, optimizer, batch)) for _, batch in pipeline.batches(examples)]
    assert len(metrics) == len(logs) == args.max_steps
    # Each step within 10x the float32 TRL run's largest distance from the float64 run (float64.trajectory_bound).
    for quantity in ("loss", "grad_norm"):
        bound = trajectory_bound([logs], exact, quantity)
        errors = [relative(getattr(m, quantity), want[quantity]) for want, m in zip(exact, metrics)]
        assert max(errors) <= bound, (quantity, errors, bound)
        print(f"{quantity}: worst {max(errors):.1e}, {max(errors) / bound:.2f} of the bound {bound:.1e}")
