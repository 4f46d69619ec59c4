"""The published Gemma 4 31B LoRA recipe, ported GPU -> TPU with gemport, in miniature.

By default it builds a tiny random Gemma 4 with the 31B layout (k_eq_v global layers with fewer KV heads,
5 sliding : 1 global) and runs on 8 simulated CPU devices in a few minutes. ``--hf-dir`` takes a real
checkpoint (with its tokenizer) and ``--fsdp/--tp`` a real TPU slice's mesh. Every step prints what it did.

    python examples/port_gemma4.py [--out DIR] [--steps 40] [--hf-dir DIR --fsdp 1 --tp 4]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

if "jax" not in sys.modules and not os.environ.get("JAX_PLATFORMS"):
    # 8 simulated devices on the host CPU; on a busy 2-core machine one device can reach an all-reduce long
    # after the others, so XLA's 40 s stuck-collective abort is raised.
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + (
        " --xla_force_host_platform_device_count=8 --xla_cpu_collective_call_terminate_timeout_seconds=900"
    )

DATA = Path(__file__).parent / "data" / "verilog_chat.jsonl"

# The GPU recipe, as the TRL/PEFT run configured it.
PEFT_CONFIG = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
               "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
TRAINING_ARGS = {"learning_rate": 3e-3, "lr_scheduler_type": "cosine", "warmup_steps": 0.1, "weight_decay": 0.01,
                 "max_grad_norm": 1.0, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8,
                 "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "seed": 42}

# Tiny, but shaped like 31B: 8 query heads, 8 sliding KV heads, 4 global K-only heads (so tp=8 fails, as on 31B).
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=8,
            num_key_value_heads=8, head_dim=16, global_head_dim=32, num_global_key_value_heads=4,
            attention_k_eq_v=True, sliding_window=64, hidden_size_per_layer_input=0, final_logit_softcapping=30.0)

EVAL_CONVERSATIONS = 8  # held out of training, for PeftTrainer's eval


def step(n: int, text: str) -> None:
    print(f"\n[{n}/9] {text}", flush=True)


def tiny_checkpoint(out: Path, conversations: list) -> None:
    """A random Gemma4ForCausalLM with the 31B layout, saved with a BPE tokenizer trained on the chats."""
    import tokenizers
    import torch
    import transformers

    from gemport.masks import Gemma4

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


@contextlib.contextmanager
def on_mesh(mesh):
    """``mesh`` as the current mesh and as the physical mesh PeftTrainer shards its batches on (`with mesh:`)."""
    import jax

    with jax.set_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # JAX 0.10 deprecates `with mesh:`; Tunix reads it
        with mesh:
            yield


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="working directory (default: a new temporary one)")
    parser.add_argument("--hf-dir", type=Path, help="a real Gemma 4 checkpoint with its tokenizer")
    parser.add_argument("--fsdp", type=int)
    parser.add_argument("--tp", type=int)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=2, help="rows per micro-batch (2 micro-batches a step)")
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args(argv)

    import grain
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    import transformers
    from tunix.sft.peft_trainer import TrainingConfig

    import gemport
    from gemport import masks, train
    from gemport.masks.grain import MaskTransform, has_target

    work = args.out or Path(tempfile.mkdtemp(prefix="gemport-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    conversations = [json.loads(line)["messages"] for line in DATA.read_text().splitlines()]

    step(1, "Base checkpoint")
    base = args.hf_dir
    if base is None:
        base = work / "base"
        shutil.rmtree(base, ignore_errors=True)
        tiny_checkpoint(base, conversations)
        print(f"built a random Gemma4ForCausalLM with the 31B layout at {base}")
    spec = gemport.GemmaSpec.from_hf(base)
    print(f"GemmaSpec: {spec.num_layers} layers, {spec.num_heads} query heads, KV heads {spec.num_kv_heads} "
          f"(sliding) / {spec.global_kv_heads} (global, k_eq_v={spec.k_eq_v}), global layers {spec.layers_of('global')}")

    step(2, "Mesh and memory plan")
    devices = jax.devices()
    try:
        gemport.make_mesh(spec, tp=len(devices))
    except gemport.MeshError as e:
        print(f"tp={len(devices)} refused before compiling:\n  {e}")
    mesh = gemport.make_mesh(spec, fsdp=args.fsdp, tp=args.tp)
    print(f"mesh: {dict(mesh.shape)} on {len(devices)} {devices[0].platform} devices")
    lora_spec = gemport.LoraSpec.from_peft(PEFT_CONFIG)
    for plan in gemport.valid_meshes(spec, len(devices), lora=lora_spec, param_dtype="float32"):
        print(f"  {plan}")

    step(3, "Load the base into Tunix, add LoRA from the PEFT config")
    with jax.set_mesh(mesh):
        model = gemport.load_model(base, spec=spec, mesh=mesh, dtype=jnp.float32)
        hit = sorted({a.module.rsplit(".", 1)[-1] for a in gemport.LoraLayout(spec, lora_spec)})
        print(f"PEFT {PEFT_CONFIG['target_modules']} r={lora_spec.rank} alpha={lora_spec.alpha} -> Qwix on {hit}")
        model = gemport.apply_lora(model, spec, lora_spec)  # each factor created in its sharding on the mesh
        report = gemport.audit(model, mesh)
        print(f"audit: {len(report)} params, {len(report.problems)} findings, "
              f"{report.bytes_per_device / 2**20:.2f} MiB per device")

    step(4, "Chat data -> masked, packed rows (a Grain pipeline with gemport's mask transform)")
    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    chat = masks.Gemma4(thinking="on", keep_reasoning=True)
    transform = MaskTransform(tokenizer, chat, masks.MaskPolicy(), masks.Truncation(max_len=args.seq_len))
    held_out = conversations[-EVAL_CONVERSATIONS:]
    records = list(grain.MapDataset.source([{"messages": c} for c in conversations[:-EVAL_CONVERSATIONS]])
                   .map_with_index(transform).filter(has_target))
    rows = masks.pack([(r["tokens"], r["loss_mask"]) for r in records], args.seq_len)
    trained = int(rows["loss_mask"].sum())
    print(f"{len(records)} conversations -> {len(rows['tokens'])} rows of {args.seq_len} tokens; "
          f"{trained} trained targets (assistant answers and <turn|>; system, user, headers and reasoning "
          f"masked); padding {1 - (rows['segment_ids'] > 0).mean():.1%}; {len(held_out)} held out for eval")
    print(f"truncation: {transform.report}")
    eval_examples, _ = masks.build(held_out, tokenizer, chat, masks.MaskPolicy(), transform.truncation)
    eval_rows = masks.pad(eval_examples, args.seq_len)
    eval_batches = [{k: v[None, i:i + 2] for k, v in eval_rows.items()} for i in range(0, len(eval_examples) - 1, 2)]

    def scoped_losses(model):
        inputs = masks.tunix_inputs(**{k: v[:args.batch_size] for k, v in rows.items()})
        logits, _ = model(inputs["input_tokens"], inputs["positions"], None, inputs["attention_mask"])
        scopes = masks.loss_scopes(logits, rows["tokens"][:args.batch_size], rows["loss_mask"][:args.batch_size],
                                   rows["segment_ids"][:args.batch_size])
        return float(scopes["masked"]), float(scopes["full_sequence"])

    step(5, "Optimizer and sample order from HF TrainingArguments")
    training_args = {**TRAINING_ARGS, "per_device_train_batch_size": args.batch_size, "max_steps": args.steps}
    hf_optimizer = gemport.hf_optimizer(training_args, num_training_steps=args.steps)
    print(f"{training_args}\n-> optax: clip (torch rule) + adamw, lr at steps 0/{args.steps // 2}/{args.steps - 1}: "
          + ", ".join(f"{float(hf_optimizer.schedule(s)):.2e}" for s in (0, args.steps // 2, args.steps - 1)))
    plan = list(gemport.optimizer_steps(training_args, len(rows["tokens"])))
    print(f"rows in the HF Trainer's order (torch's RandomSampler, seed {training_args['seed']}): step 0 takes "
          f"{[m.tolist() for m in plan[0].micro_batches]}; {plan[-1].epoch + 1} epochs")

    step(6, "Train with Tunix's PeftTrainer (gemport.train.peft_trainer: HF's token-weighted accumulation)")
    root = work / "checkpoints"
    shutil.rmtree(root, ignore_errors=True)
    accumulation = training_args["gradient_accumulation_steps"]
    steps = [train.stack([{k: v[m] for k, v in rows.items()} for m in s.micro_batches],
                         accumulation=accumulation, rows=args.batch_size) for s in plan]
    config = TrainingConfig(
        eval_every_n_steps=args.steps, max_steps=args.steps, gradient_accumulation_steps=accumulation,
        checkpoint_root_directory=str(root), max_inflight_computations=1,
        checkpointing_options=ocp.CheckpointManagerOptions(save_interval_steps=10, max_to_keep=2),
    )
    with on_mesh(mesh):
        before = scoped_losses(model)
        # It records the LoraSpec beside the checkpoints; pointed at a root with checkpoints, it resumes.
        trainer = gemport.HFPeftTrainer(model, hf_optimizer.tx, config, lora_spec=lora_spec)
        trainer.train(gemport.micro_batches(steps), gemport.micro_batches(eval_batches))
        after = scoped_losses(model)
    history = {(mode, name): trainer.metrics_logger.get_metric_history("", name, mode)
               for mode in ("train", "eval") for name in ("loss", "masked_loss", "full_sequence_loss")}
    grad_norm = trainer.metrics_logger.get_metric_history("", "grad_norm", "train")
    print(f"train loss (HF's, per step) {history['train', 'loss'][0]:.3f} -> {history['train', 'loss'][-1]:.3f}, "
          f"grad_norm {grad_norm[0]:.3f} -> {grad_norm[-1]:.3f}; "
          f"held-out assistant-only loss {history['eval', 'masked_loss'][0]:.3f} -> "
          f"{history['eval', 'masked_loss'][-1]:.3f}, full-sequence {history['eval', 'full_sequence_loss'][0]:.3f} -> "
          f"{history['eval', 'full_sequence_loss'][-1]:.3f}")
    print(f"assistant-only loss {before[0]:.3f} -> {after[0]:.3f}; full-sequence loss {before[1]:.3f} -> "
          f"{after[1]:.3f} (report both: they are different numbers for the same model)")
    print(f"Orbax checkpoint: {sorted(p.name for p in root.iterdir())}")

    step(7, "Export: merged HF safetensors (for vLLM) and a PEFT adapter")
    merged = work / "merged"
    adapter = work / "adapter"
    for path in (merged, adapter):
        shutil.rmtree(path, ignore_errors=True)
    gemport.export_merged(root, merged, base_dir=base)
    gemport.export_peft(root, adapter, base_dir=base)
    print(f"merged: {merged}\nadapter: {adapter} ({sorted(p.name for p in adapter.iterdir())})")

    step(8, "Check: transformers on the exports vs the trained Tunix model")
    with jax.set_mesh(mesh):
        reports = {"merged": gemport.compare_logits(merged, model),
                   "peft": gemport.compare_logits(base, model, adapter_dir=adapter)}
    for name, report in reports.items():
        print(f"{name}: {report}")

    step(9, "Done")
    ok = all(r.ok for r in reports.values()) and after[0] < before[0]
    print(f"{'PASS' if ok else 'FAIL'}: outputs in {work}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
