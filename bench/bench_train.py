"""LoRA train step: step time, tokens/s, MFU and peak device memory, beside the memory plan's prediction.

The step is the one ``SFTRun.train()`` runs (``HFPeftTrainer.jitted_train_step``, compiled as ``gemport.plan``
compiles it: TRL's default recipe, HF's AdamW with clipping, model and optimizer state donated) on a Gemma 4
with Gemma 4 31B's layout, twice: Tunix's own attention and logits (``HFPeftTrainer(loss_fn=step.tunix_loss)``),
and gemport's segment loss (segment attention, chunked cross-entropy: ``step.segment_loss``). MFU is model FLOPs
per trained token (``4 x`` the
weights a token passes through, forward and backward through the activations, plus ``12 x`` keys seen x head
width x heads per layer for attention) times tokens/s over the device's bf16 peak (``PEAK_TFLOPS``); on CPU
there is no accelerator figure. On CPU (default: tiny widths, under a minute) the peak is what XLA's
compiled memory analysis reserves (arguments + outputs + temporaries, donated buffers once), since the CPU
reports no allocator statistics; on an accelerator it is the device's ``peak_bytes_in_use``. Where torch sees
a CUDA device, PEFT's step on the same model (HF Gemma 4, the same LoRA targets, torch AdamW; sdpa attention,
and FlashAttention-2 where ``flash_attn`` is installed) runs as the baseline and the fast step's ratio is printed. Usage:

    python bench/bench_train.py                      # CPU, tiny widths
    python bench/bench_train.py --widths 31b --layers 2 --vocab 262144 --batch 8 --seq-len 2048 \\
        --fsdp 1 --tp 4 --remat decoder --dtype bfloat16  # a TPU v5p-8: Gemma 4 31B's widths, 2 layers
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gemport.plan.compiled import CPU_MEMORY_SCHEDULER  # noqa: E402

if os.environ.get("JAX_PLATFORMS", "") in ("", "cpu") and CPU_MEMORY_SCHEDULER not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {CPU_MEMORY_SCHEDULER}".strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402
from gemport.plan.compiled import _placed, compile_step, step_trainer  # noqa: E402
from gemport.step import segment_loss, tunix_loss  # noqa: E402
from gemport.run.model import lora_model  # noqa: E402
from gemport.run.trainer import NUM_ITEMS  # noqa: E402

from gemport.lora import LoraSpec  # noqa: E402
from gemport.mesh import make_mesh  # noqa: E402
from gemport.mesh.dims import FSDP  # noqa: E402
from gemport.plan import memory_plan  # noqa: E402
from gemport.plan.activations import REMAT  # noqa: E402
from gemport.specs import GemmaSpec  # noqa: E402
from flops import flops_per_token, peak_tflops  # noqa: E402

GiB = 2**30

def bench_spec(widths: str, layers: int, vocab: int) -> GemmaSpec:
    """Gemma 4 31B's layout (5 sliding : 1 global, k_eq_v global layers) at its real widths or tiny ones."""
    g31 = GemmaSpec.preset("gemma4-31b")
    types = tuple("global" if (i + 1) % 6 == 0 or i == layers - 1 else "sliding" for i in range(layers))
    spec = dataclasses.replace(g31, num_layers=layers, layer_types=types, vocab=vocab)
    if widths == "tiny":
        spec = dataclasses.replace(spec, hidden=128, mlp=512, num_heads=4, head_dim=32, num_kv_heads=2,
                                   global_head_dim=64, global_kv_heads=1, sliding_window=64)
    return spec


def placed(graph, mesh):
    """``graph`` (model or optimizer) with its values on ``mesh`` in the shardings the planned step lowers them with."""
    abstract = nnx.state(_placed(graph, mesh))
    state = jax.tree.map(lambda v, a: v.replace(jax.device_put(v.get_value(), a.get_value().sharding)),
                         nnx.state(graph), abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(nnx.graphdef(graph), state)


def batch_arrays(batch, seq_len, vocab, mesh):
    rng = np.random.default_rng(0)
    values = {
        "tokens": rng.integers(0, vocab, (batch, seq_len), dtype=np.int32),
        "positions": np.broadcast_to(np.arange(seq_len, dtype=np.int32), (batch, seq_len)).copy(),
        "segment_ids": np.ones((batch, seq_len), np.int32),
        "loss_mask": np.ones((batch, seq_len), bool),
        NUM_ITEMS: np.full(batch, batch * (seq_len - 1), np.int32),
    }
    rows = NamedSharding(mesh, PartitionSpec(FSDP))
    return {k: jax.device_put(v, rows) for k, v in values.items()}


def jax_step(args, spec, lora_spec, dtype, loss_fn):
    """The step ``SFTRun.train()`` runs (``HFPeftTrainer.jitted_train_step``, TRL's default recipe: HF's AdamW with
    clipping), compiled as ``gemport.plan`` compiles it and then run on random weights."""
    mesh = make_mesh(spec, fsdp=args.fsdp, tp=args.tp, devices=jax.devices()[: args.fsdp * args.tp])
    model = lora_model(spec, lora_spec, param_dtype=dtype, remat=args.remat, abstract=False)
    trainer = step_trainer(model, {"gradient_checkpointing": args.remat == "decoder"}, loss_fn=loss_fn)
    compiled = compile_step(trainer, mesh, args.batch, args.seq_len)
    model, optimizer = placed(trainer.model, mesh), placed(trainer.optimizer, mesh)
    batch = batch_arrays(args.batch, args.seq_len, spec.vocab, mesh)
    step = trainer.jitted_train_step()
    times = []
    with jax.set_mesh(mesh):
        for i in range(args.steps + 1):
            start = time.perf_counter()
            loss, _, _ = step(model, optimizer, batch)
            loss.block_until_ready()
            if i:  # the first call compiles
                times.append(time.perf_counter() - start)
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return min(times), peak, compiled, float(loss)


def torch_step(args, spec, lora_spec, attn_implementation):
    """PEFT's step on CUDA: HF Gemma 4 with LoRA on the same projections, torch AdamW, the given attention."""
    import torch
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    cfg = tf.Gemma4TextConfig(**spec.to_hf_config(), attn_implementation=attn_implementation)
    model = tf.Gemma4ForCausalLM(cfg).to("cuda", dtype=getattr(torch, args.dtype))
    model = get_peft_model(model, LoraConfig(r=lora_spec.rank, lora_alpha=lora_spec.alpha,
                                             target_modules=list(lora_spec.targets)))
    if args.remat != "none":
        model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    tokens = torch.randint(0, spec.vocab, (args.batch, args.seq_len), device="cuda")
    times = []
    for i in range(args.steps + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
    return min(times), torch.cuda.max_memory_allocated()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--widths", choices=("tiny", "31b"), default="tiny")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--fsdp", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--remat", choices=REMAT, default="none")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--dtype", default="float32", help="param and compute dtype (XLA:CPU computes bf16 in f32)")
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()

    spec = bench_spec(args.widths, args.layers, args.vocab)
    lora_spec = LoraSpec(rank=args.rank, alpha=2 * args.rank)
    dtype = jnp.dtype(args.dtype)
    backend = jax.default_backend()
    plan = memory_plan(spec, args.fsdp, args.tp, lora_spec=lora_spec, param_dtype=dtype, batch=args.batch,
                       seq_len=args.seq_len, remat=args.remat, backend="cpu" if backend == "cpu" else "tpu")
    tokens = args.batch * args.seq_len
    kind = jax.devices()[0].device_kind
    peak_flops = peak_tflops(kind) if backend != "cpu" else None
    print(f"{backend} ({kind}): {args.widths} widths, {args.layers} layers, vocab {args.vocab}, mesh fsdp={args.fsdp} "
          f"tp={args.tp}, batch {args.batch} x {args.seq_len}, remat {args.remat}, LoRA r={args.rank}, {args.dtype}")
    print(f"  plan (the fast step): {plan}")
    print(f"    {plan.tunix_line}")
    step_seconds = {}
    for name, loss_fn in (("Tunix step", tunix_loss), ("fast step", segment_loss)):
        seconds, peak, compiled, loss = jax_step(args, spec, lora_spec, dtype, loss_fn)
        measured, how = (peak, "peak_bytes_in_use") if peak else (compiled.peak_bytes, "compiled memory analysis")
        rate = tokens / seconds
        if peak_flops is None:
            mfu = "MFU: no accelerator figure (CPU)" if backend == "cpu" else f"MFU: no bf16 peak known for {kind}"
        else:
            mfu = f"MFU {rate * flops_per_token(spec, args.seq_len) / (peak_flops * 1e12 * args.fsdp * args.tp):.1%}"
        step_seconds[name] = seconds
        print(f"  {name}: {seconds * 1e3:.1f} ms, {rate:,.0f} tokens/s, {mfu} (loss {loss:.3f}); peak per device "
              f"({how}) {measured / GiB:.3f} GiB")
    import torch

    if not torch.cuda.is_available():
        print("  PEFT baseline: skipped (torch sees no CUDA device)")
        return
    attentions = ["sdpa"] + (["flash_attention_2"] if importlib.util.find_spec("flash_attn") else [])
    for attn_implementation in attentions:
        t_seconds, t_peak = torch_step(args, spec, lora_spec, attn_implementation)
        print(f"  PEFT step (CUDA, {attn_implementation}): {t_seconds * 1e3:.1f} ms, {tokens / t_seconds:,.0f} tokens/s, "
              f"peak {t_peak / GiB:.3f} GiB; gemport's fast step / PEFT tokens/s: {t_seconds / step_seconds['fast step']:.2f}x")


if __name__ == "__main__":
    main()
