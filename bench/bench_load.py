"""Load time and peak RSS: gemport.load_hf vs Tunix's own loader vs `cp`, on a 31B-shaped bf16 checkpoint.

Each loader runs in a fresh process that reports its own wall time and peak RSS (ru_maxrss); the
checkpoint is read once first, so every contender sees a warm page cache. Usage:

    python bench/bench_load.py [--layers 2] [--dir /tmp/gemport-bench]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from synthetic import write_checkpoint  # noqa: E402

_CHILD = r"""
import json, resource, sys, time
import jax, jax.numpy as jnp
sys.path.insert(0, {bench!r})
from synthetic import spec_31b
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
start = time.perf_counter()
if {who!r} == "gemport":
    from gemport.checkpoint import load_hf
    state = load_hf({path!r}, dtype=jnp.bfloat16)
    jax.block_until_ready(jax.tree.leaves(state))
else:
    from tunix.models.gemma4 import params_safetensors
    cfg = spec_31b({layers}).to_tunix(param_dtype=jnp.bfloat16)
    model = params_safetensors.create_model_from_safe_tensors({path!r}, cfg, dtype=jnp.bfloat16)
    from flax import nnx
    jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
print(json.dumps({{"seconds": time.perf_counter() - start, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "base": base}}))
"""


def run(who: str, path: Path, layers: int) -> dict:
    code = _CHILD.format(who=who, path=str(path), layers=layers, bench=str(Path(__file__).parent))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"JAX_PLATFORMS": "cpu", **__import__("os").environ})
    if out.returncode:
        return {"error": out.stderr.strip().splitlines()[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "gemport-bench-load")
    args = parser.parse_args()
    ckpt = args.dir / f"ckpt-{args.layers}"
    if not ckpt.exists():
        # Tunix's loader matches only model.language_model.* keys, so both loaders read this layout.
        write_checkpoint(ckpt, args.layers, prefix="model.language_model.")
    nbytes = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    gib = 2**30

    copy = args.dir / "copy"
    shutil.rmtree(copy, ignore_errors=True)
    start = time.perf_counter()
    subprocess.run(["cp", "-r", str(ckpt), str(copy)], check=True)
    cp_seconds = time.perf_counter() - start
    shutil.rmtree(copy)

    print(f"checkpoint: {args.layers} layers of gemma4-31b, bf16, {nbytes / gib:.2f} GiB")
    print(f"cp: {cp_seconds:.1f} s")
    results = {who: run(who, ckpt, args.layers) for who in ("gemport", "tunix")}
    for who, r in results.items():
        if "error" in r:
            print(f"{who}: failed: {r['error']}")
            continue
        print(f"{who}: {r['seconds']:.1f} s ({r['seconds'] / cp_seconds:.2f}x cp), peak RSS {r['peak'] / gib:.2f} GiB "
              f"= {r['peak'] / nbytes:.2f}x checkpoint (process baseline {r['base'] / gib:.2f} GiB); "
              f"target <= 1.3x + 1 GiB = {(1.3 * nbytes + gib) / gib:.2f} GiB")
    g, t = results["gemport"], results["tunix"]
    if "error" not in g and "error" not in t:
        print(f"gemport vs tunix: time {g['seconds'] / t['seconds']:.2f}x, peak RSS {g['peak'] / t['peak']:.2f}x")


if __name__ == "__main__":
    main()
