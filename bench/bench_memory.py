"""Compiled peak per device of the train step ``SFTRun.train()`` runs (``gemport.plan.compiled``: HFPeftTrainer's
jitted step with TRL's default recipe, HF's AdamW with clipping) at Gemma 4 31B's widths, with Tunix's attention and
logits (``HFPeftTrainer(loss_fn=step.tunix_loss)``) against gemport's fast loss.

Two layers (one sliding, one global), vocabulary 262144, LoRA r=16 on all seven projections, bf16, decoder
remat, one row per device: lowered for abstract arguments and compiled on this host (nothing allocated), XLA's
memory analysis read. For the host's CPU (one device), or with ``--tpu SLICE`` for a TPU slice's chips by
libtpu's compiler (fsdp over all of them, one row each; ``pip install 'gemport[tpu]'``). A minute or so per
case. ``python bench/bench_memory.py [seq_len ...] [--vocab V] [--tpu v5p-8]``.
"""

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gemport.plan.compiled import CPU_MEMORY_SCHEDULER  # noqa: E402

os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {CPU_MEMORY_SCHEDULER}".strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from gemport.plan.compiled import compile_step, step_trainer  # noqa: E402
from gemport.step import segment_loss, tunix_loss  # noqa: E402
from gemport.run.model import lora_model  # noqa: E402

from gemport.lora import LoraSpec  # noqa: E402
from gemport.mesh import make_mesh  # noqa: E402
from gemport.mesh.tpu import slice_devices  # noqa: E402
from gemport.specs import GemmaSpec  # noqa: E402

GiB = 2**30
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("seq_len", type=int, nargs="*", default=[4096, 8192])
    parser.add_argument("--vocab", type=int, default=262144)
    parser.add_argument("--remat", default="decoder")
    parser.add_argument("--steps", nargs="+", default=["fast", "tunix"], choices=["fast", "tunix"])
    parser.add_argument("--tpu", metavar="SLICE", help="compile for this TPU slice's chips (e.g. v5p-8)")
    args = parser.parse_args()
    if args.tpu and "JAX_PLATFORMS" not in os.environ:
        jax.config.update("jax_platforms", "cpu")  # the slice's compiler needs no TPU here
    spec = dataclasses.replace(GemmaSpec.preset("gemma4-31b"), num_layers=2, layer_types=("sliding", "global"),
                               vocab=args.vocab)
    model = lora_model(spec, LoraSpec(rank=16, alpha=32, targets=TARGETS), remat=args.remat,
                       param_dtype=jnp.bfloat16)
    devices = slice_devices(args.tpu) if args.tpu else jax.devices()[:1]
    mesh = make_mesh(spec, fsdp=len(devices), tp=1, devices=devices)
    compiler = f"TPU {args.tpu} (libtpu, {len(devices)} chips, fsdp={len(devices)})" if args.tpu else \
        f"XLA:{jax.default_backend().upper()}"
    print(f"Gemma 4 31B widths, 2 layers, vocab {args.vocab}, LoRA r=16 x 7, bf16, remat {args.remat}, one row per "
          f"device; {compiler} compiled memory analysis, per device")
    for seq_len in args.seq_len:
        for name in args.steps:
            start = time.perf_counter()
            compiled = compile_step(step_trainer(model, loss_fn=segment_loss if name == "fast" else tunix_loss), mesh, len(devices), seq_len)
            print(f"{seq_len:6d} tokens  {name:5s} step: peak {compiled.peak_bytes / GiB:6.2f} GiB "
                  f"(arguments {compiled.argument_bytes / GiB:.2f}, temporaries {compiled.temp_bytes / GiB:.2f}), "
                  f"{compiled.flops_per_token / 1e9:.2f} GFLOPs/token "
                  f"compiled in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
