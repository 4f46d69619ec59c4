"""gemport.step's HF Trainer step beside the demo's former hand-written LoRA step, on CPU.

Both train the same Qwix LoRA on the same random Tunix Gemma 4 (31B layout, small widths) with the same
rows: the baseline is the loop the demo used to write by hand (``nnx.value_and_grad`` of the mean masked
loss over the whole batch, one ``nnx.Optimizer`` update, no grad_norm); ``train_step`` takes the same rows
as one micro-batch (A=1) and as two micro-batches of half the rows (A=2, HF's gradient accumulation), and
also returns HF's logged loss and pre-clip grad_norm. Compile time is reported apart; step times are CPU
seconds of this process (all XLA threads; other load on the machine skews them less than wall-clock), best
of 3 runs of ``--steps`` steps, after a warm-up, with wall-clock beside. Compare the ratios.

    python bench/bench_step.py [--rows 4] [--seq-len 256] [--steps 10]
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import qwix  # noqa: E402
from flax import nnx  # noqa: E402
from tunix.models.gemma4 import model as gemma4  # noqa: E402

from gemport.data import pad, stack, tunix_inputs

from gemport.step import masked_cross_entropy, train_step
from gemport.optim import hf_optimizer  # noqa: E402

CONFIG = dict(num_layers=6, num_embed=4096, embed_dim=256, hidden_dim=1024, num_heads=8, head_dim=32,
              num_kv_heads=4, global_key_size=64, num_global_kv_heads=2, k_eq_v_global=True,
              sliding_window_size=128, per_layer_input_dim=0)
ARGS = {"learning_rate": 1e-3, "weight_decay": 0.01, "max_grad_norm": 1.0, "lr_scheduler_type": "cosine",
        "warmup_steps": 2}


def lora_model():
    config = gemma4.ModelConfig(**{k: v for k, v in CONFIG.items() if k in gemma4.ModelConfig.__dataclass_fields__})
    model = gemma4.Gemma4(config, rngs=nnx.Rngs(0))
    provider = qwix.LoraProvider(module_path=".*q_einsum|.*kv_einsum|.*attn_vec_einsum|.*_proj", rank=16, alpha=32.0)
    return qwix.apply_lora_to_model(model, provider, rngs=nnx.Rngs(1), **model.get_model_input())


def rows(n, seq_len, vocab, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(seq_len // 2, seq_len + 1, n)
    tokens = [rng.integers(1, vocab, k) for k in lengths]
    loss_mask = [np.arange(k) >= k // 3 for k in lengths]
    return pad(list(zip(tokens, loss_mask)), seq_len)


def baseline_step():
    @nnx.jit
    def step(model, optimizer, batch):
        def loss_fn(model):
            inputs = tunix_inputs(**batch)
            logits, _ = model(inputs["input_tokens"], inputs["positions"], None, inputs["attention_mask"])
            return masked_cross_entropy(logits, batch["tokens"], batch["loss_mask"])

        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
        optimizer.update(model, grads)
        return loss

    return step


def timed(step, batch, steps):
    model = lora_model()
    optimizer = nnx.Optimizer(model, hf_optimizer(ARGS, num_training_steps=1000).tx, wrt=nnx.LoRAParam)
    start = time.perf_counter()
    jax.block_until_ready(step(model, optimizer, batch))
    compile_seconds = time.perf_counter() - start
    best, wall = float("inf"), float("inf")
    for _ in range(3):
        start, start_wall = time.process_time(), time.perf_counter()
        for _ in range(steps):
            out = step(model, optimizer, batch)
        jax.block_until_ready(out)
        best = min(best, (time.process_time() - start) / steps)
        wall = min(wall, (time.perf_counter() - start_wall) / steps)
    return compile_seconds, best, wall


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    batch = rows(args.rows, args.seq_len, CONFIG["num_embed"])
    half = args.rows // 2
    cases = {
        "demo loop (mean loss, no grad_norm)": (baseline_step(), batch),
        "train_step, A=1": (train_step(), stack([batch])),
        f"train_step, A=2 x {half} rows": (
            train_step(),
            stack([{k: v[:half] for k, v in batch.items()}, {k: v[half:] for k, v in batch.items()}]),
        ),
    }
    print(f"Tunix Gemma 4 ({CONFIG['num_layers']} layers, D={CONFIG['embed_dim']}), Qwix LoRA r=16 on every "
          f"projection, {args.rows} rows x {args.seq_len} tokens, {jax.devices()[0].platform}")
    results = {name: timed(step, b, args.steps) for name, (step, b) in cases.items()}
    base = results["demo loop (mean loss, no grad_norm)"][1]
    for name, (compile_seconds, seconds, wall) in results.items():
        print(f"{name:40s} compile {compile_seconds:5.1f} s   step {seconds * 1e3:7.1f} ms CPU "
              f"({wall * 1e3:7.1f} ms wall)   x{seconds / base:.2f}")


if __name__ == "__main__":
    main()
