"""The published Gemma 4 31B LoRA recipe, ported GPU -> TPU with gemport, in miniature.

By default it builds a tiny random Gemma 4 with the 31B layout (k_eq_v global layers with fewer KV heads,
5 sliding : 1 global) and trains it in float32 in a few minutes. ``--hf-dir`` takes a real checkpoint (with its
tokenizer), trained in the recipe's dtype (TRL's default ``bf16``: a bfloat16 base), and ``--fsdp/--tp`` a real
TPU slice's mesh. It runs on the JAX devices present (a TPU slice, GPUs); only where there are none, or with
``--cpu``, on 8 simulated CPU devices. The recipe itself is the short path: ``gemport.SFTRun`` from the SFTConfig
and LoraConfig fields, ``train()``, the two exports and their checks.

    python examples/port_gemma4.py [--out DIR] [--steps 40] [--hf-dir DIR --fsdp 1 --tp 4] [--cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

DATA = Path(__file__).parent / "data" / "verilog_chat.jsonl"

# The GPU recipe, as the TRL/PEFT run configured it: PEFT's LoraConfig and TRL's SFTConfig fields.
PEFT_CONFIG = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
               "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
SFT_CONFIG = {"assistant_only_loss": True, "packing": True, "max_length": 384,  # the longest chat is 379 tokens
              "learning_rate": 3e-3, "lr_scheduler_type": "cosine", "warmup_steps": 4, "weight_decay": 0.01,
              "max_grad_norm": 1.0, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "seed": 42,
              "eval_strategy": "steps", "eval_steps": 20, "per_device_eval_batch_size": 4, "save_steps": 10,
              "save_total_limit": 2}  # bf16 left at TRL's default (on): the base trains in bfloat16

# Tiny, but shaped like 31B: 8 query heads, 8 sliding KV heads, 4 global K-only heads (so tp=8 fails, as on 31B).
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=8,
            num_key_value_heads=8, head_dim=16, global_head_dim=32, num_global_key_value_heads=4,
            attention_k_eq_v=True, sliding_window=64, hidden_size_per_layer_input=0, final_logit_softcapping=30.0)

EVAL_CONVERSATIONS = 8  # held out of training, for the trainer's eval


def jax_environment(cpu: bool, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to set before JAX starts (returned, not set): 8 simulated devices for the host CPU platform,
    which JAX uses only when no accelerator is present, and ``JAX_PLATFORMS=cpu`` only when ``cpu`` asks.

    On a busy 2-core machine one simulated device can reach an all-reduce long after the others, so XLA's 40 s
    stuck-collective abort is raised too. A ``JAX_PLATFORMS`` or host device count already set is kept.
    """
    out = {}
    flags = environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        out["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8"
                            " --xla_cpu_collective_call_terminate_timeout_seconds=900").strip()
    if cpu:
        out["JAX_PLATFORMS"] = "cpu"
    return out


def sft_config(hf_dir: Path | None, steps: int, output_dir: Path) -> dict:
    """The recipe's SFTConfig fields for this run: a real checkpoint in the recipe's dtype (TRL's ``bf16``), the
    random miniature in float32 (its checks compare float32 computations)."""
    config = {**SFT_CONFIG, "max_steps": steps, "output_dir": str(output_dir)}
    if hf_dir is None:
        config["bf16"] = False
    return config


def tiny_checkpoint(out: Path, conversations: list) -> Path:
    """A random Gemma4ForCausalLM with the 31B layout, saved with a BPE tokenizer trained on the chats."""
    import tokenizers
    import torch
    import transformers

    from gemport.data import Gemma4

    texts = [m["content"] + " " + m.get("reasoning", "") for c in conversations for m in c]
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=TINY["vocab_size"], special_tokens=["<pad>", "<eos>", "<unk>", *Gemma4.control_tokens],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<bos>", eos_token="<eos>",
                                                     pad_token="<pad>", unk_token="<unk>")
    ids = tokenizer.convert_tokens_to_ids
    config = transformers.Gemma4TextConfig(**TINY, pad_token_id=ids("<pad>"), eos_token_id=ids("<turn|>"),
                                           bos_token_id=ids("<bos>"))
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="working directory (default: a new temporary one)")
    parser.add_argument("--hf-dir", type=Path, help="a real Gemma 4 checkpoint with its tokenizer")
    parser.add_argument("--fsdp", type=int)
    parser.add_argument("--tp", type=int)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--cpu", action="store_true", help="run on 8 simulated CPU devices even where an "
                                                           "accelerator is present")
    args = parser.parse_args(argv)
    if "jax" not in sys.modules:
        os.environ.update(jax_environment(args.cpu, os.environ))

    import jax

    import gemport

    work = args.out or Path(tempfile.mkdtemp(prefix="gemport-demo-"))
    shutil.rmtree(work / "run", ignore_errors=True)
    records = [json.loads(line) for line in DATA.read_text().splitlines()]
    base = args.hf_dir or tiny_checkpoint(work / "base", [r["messages"] for r in records])

    # The recipe, ported: everything below is gemport's public surface.
    spec = gemport.GemmaSpec.from_hf(base)
    print(f"{base}: {spec.num_layers} layers, KV heads {spec.num_kv_heads} sliding / {spec.global_kv_heads} global "
          f"(k_eq_v={spec.k_eq_v}); valid meshes on {jax.device_count()} devices:")
    for plan in gemport.valid_meshes(spec, jax.device_count(), lora_spec=gemport.LoraSpec.from_peft(PEFT_CONFIG)):
        print(f"  {plan}")
    run = gemport.SFTRun.create(
        sft_config(args.hf_dir, args.steps, work / "run"), base,
        records[:-EVAL_CONVERSATIONS], eval_dataset=records[-EVAL_CONVERSATIONS:], lora=PEFT_CONFIG,
        fsdp=args.fsdp, tp=args.tp, chat_format=gemport.data.Gemma4(thinking="on", keep_reasoning=True))
    print(f"mesh {dict(run.mesh.shape)}; {len(run.examples)} chats -> {run.max_steps} steps of "
          f"{run.train_batches[0]['tokens'].shape} (A, B, T) packed rows; truncation: {run.report}")
    trainer = run.train()
    history = {(mode, name): trainer.metrics_logger.get_metric_history("", name, mode)
               for mode in ("train", "eval") for name in ("loss", "grad_norm", "masked_loss", "full_sequence_loss")
               if (mode, name) != ("eval", "grad_norm")}
    for (mode, name), values in history.items():
        print(f"{mode} {name}: {values[0]:.3f} -> {values[-1]:.3f}")
    merged = run.export_merged(work / "merged")  # the LoRA spec travels with the model: no lora_spec=
    adapter = run.export_peft(work / "adapter")
    with jax.set_mesh(run.mesh):
        reports = {"merged": gemport.compare_logits(merged, run.model),
                   "peft": gemport.compare_logits(base, run.model, adapter_dir=adapter)}
    for name, report in reports.items():
        print(f"transformers on the {name} export vs the trained Tunix model: {report}")
    learned = history["eval", "masked_loss"][-1] < history["eval", "masked_loss"][0]
    ok = all(r.ok for r in reports.values()) and learned
    print(f"{'PASS' if ok else 'FAIL'}: outputs in {work}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
