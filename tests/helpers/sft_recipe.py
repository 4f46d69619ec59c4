"""The SFT recipe the tests train tiny models with on ``chats()``: ``CONFIG`` as SFTConfig fields, ``RECIPE`` as a
``trl sft --config`` file's (its LoRA fields included), and ``float64_logs``, TRL's run of ``CONFIG`` in float64."""

import peft
import torch
import transformers
from chats import tokenizer
from float64 import TorchFloat64
from trl import SFTConfig, SFTTrainer

CONFIG = dict(assistant_only_loss=True, packing=True, max_length=128, per_device_train_batch_size=2,
              gradient_accumulation_steps=2, max_steps=4, learning_rate=5e-3, weight_decay=0.1, max_grad_norm=0.5,
              lr_scheduler_type="cosine", warmup_steps=1, seed=3, logging_steps=1, report_to="none",
              save_strategy="no", use_cpu=True, bf16=False)


def float64_logs(base, tmp_path, data, save_to=None):
    """The TRL run of test_packed_run_matches_trl without float32 steps (float64.py), from its adapter0;
    backward runs outside the mode (autograd's thread), so no recomputed forward there. The trained adapter is
    saved (in float64) to ``save_to`` if given."""
    with TorchFloat64():
        model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64, attn_implementation="eager")
        model = peft.PeftModel.from_pretrained(model, tmp_path / "adapter0", is_trainable=True)
        args = SFTConfig(output_dir=str(tmp_path / "trl-float64"), **CONFIG, gradient_checkpointing=False)
        trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer())
        trainer.train()
        if save_to is not None:
            model.save_pretrained(save_to)
    return [e for e in trainer.state.log_history if "loss" in e]


RECIPE = dict(assistant_only_loss=True, max_length=128, per_device_train_batch_size=2, gradient_accumulation_steps=2,
              max_steps=4, learning_rate=5e-3, weight_decay=0.1, max_grad_norm=0.5, lr_scheduler_type="cosine",
              warmup_steps=1, seed=3, lora_r=4, lora_alpha=8, lora_dropout=0.0,
              lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
