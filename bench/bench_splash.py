"""Splash attention's tiles on a TPU chip: gemport's splash call (``step.attention._splash``, what the fast step runs
on TPU) forward and backward at the trained steps' attention shapes, with each candidate tiling, against JAX's
default tiling (``BlockSizes.get_default()``, 128 everywhere) in the same run.

Each case is one layer's attention on packed rows of four segments, bf16, at the shapes of issue 44's point 1
(Gemma 3 1B: 4 x 2048 tokens, 4 query heads on 1 KV head of width 256, window 512; Gemma 4 31B: 2 x 4096 tokens, 32
query heads on 16 KV heads of width 256, window 1024, and on 4 of width 512 on global layers). Prints and records
(``--record``) each tiling's milliseconds and its ratio to the default's. On the TPU machine, after
``source .whl-tpu/setup.sh``:

    python bench/bench_splash.py --record bench/splash.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from gemport.step.attention import splash_tiles

sys.path.insert(0, str(Path(__file__).parent))

# name: (rows, length, query heads, KV heads, head width, window or None)
SHAPES = {
    "1b-sliding": (4, 2048, 4, 1, 256, 512),
    "1b-global": (4, 2048, 4, 1, 256, None),
    "31b-sliding": (2, 4096, 32, 16, 256, 1024),
    "31b-global": (2, 4096, 32, 4, 512, None),
}


CANDIDATES = {
    "default (128)": None,
    "256": splash_tiles(256, 256),
    "512": splash_tiles(512, 512),
    "512, fused backward": splash_tiles(512, 512, fused=True),
    "q 512, kv 1024": splash_tiles(512, 1024),
    "1024": splash_tiles(1024, 1024),
}


def time_case(shape: str, blocks: dict | None, steps: int = 10) -> float:
    """Milliseconds of one forward and backward pass of ``_splash`` at ``shape`` with tiling ``blocks``."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

    from gemport.step import attention

    if blocks is None:  # JAX's own tiles
        blocks = dataclasses.asdict(splash.BlockSizes.get_default())

    rows, length, heads, kv_heads, width, window = SHAPES[shape]
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (rows, length, heads, width), jnp.bfloat16)
    k = jax.random.normal(keys[1], (rows, length, kv_heads, width), jnp.bfloat16)
    v = jax.random.normal(keys[2], (rows, length, kv_heads, width), jnp.bfloat16)
    g = jax.random.normal(keys[3], q.shape, jnp.bfloat16)
    segment_ids = jnp.broadcast_to(jnp.arange(length) // (length // 4), (rows, length))

    def loss(q, k, v):
        out = attention._splash(q, k, v, segment_ids, window, blocks=blocks)
        return jnp.sum(out.astype(jnp.float32) * g)

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    jax.block_until_ready(step(q, k, v))
    start = time.perf_counter()
    for _ in range(steps):
        out = step(q, k, v)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / steps * 1e3


def main():
    import bench_tpu

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--record", type=Path, help="append each result to this JSON lines file")
    args = parser.parse_args()
    import jax

    if jax.default_backend() != "tpu":
        raise SystemExit(f"bench_splash measures a TPU chip; this host's JAX has {jax.default_backend()}")
    for shape in args.shapes:
        baseline = None
        for name, blocks in CANDIDATES.items():
            try:
                ms = time_case(shape, blocks)
                result = dict(shape=shape, tiling=name, blocks=blocks, ms=ms)
            except Exception as e:  # noqa: BLE001 - a tiling the kernel refuses is a result too
                result = dict(shape=shape, tiling=name, blocks=blocks, error=f"{type(e).__name__}: {e}"[:300])
            baseline = result.get("ms") if blocks is None else baseline
            if baseline and "ms" in result:
                result["vs_default"] = baseline / result["ms"]
            result.update(bench_tpu.versions())
            print(json.dumps(result), flush=True)
            if args.record:
                with args.record.open("a") as f:
                    f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
