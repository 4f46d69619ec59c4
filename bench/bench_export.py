"""export_merged time and peak RSS vs `cp` and vs a load-everything merge, on 31B-shaped bf16 checkpoints.

For each layer count: a synthetic Gemma 4 31B-shaped checkpoint (bench/synthetic.py) and a random rank-16
adapter on every projection. Each contender runs in a fresh process that reports its own wall time and peak
RSS (ru_maxrss); the checkpoint is read once first so that all see a warm page cache. The load-everything
merge reads every shard into memory, adds the deltas and writes one file, as Tunix's generic merge helper
does; it is skipped when it would not fit in memory. Usage:

    python bench/bench_export.py [--layers 2 4 8] [--rank 16] [--dir /tmp/gemport-bench-export]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from synthetic import spec_31b, write_checkpoint  # noqa: E402

from gemport.lora import LoraSpec, targets  # noqa: E402

GIB = 2**30

_CHILD = r"""
import json, resource, sys, time
import numpy as np
who, base, adapter, out, rank = sys.argv[1:6]
params = dict(np.load(adapter))
from gemport.lora import LoraSpec
lora_spec = LoraSpec(int(rank), 2.0 * int(rank))
start_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
start = time.perf_counter()
if who == "export_merged":
    from gemport.checkpoint import export_merged
    export_merged(base, params, out, lora_spec=lora_spec, max_shard_size="2GB")
else:
    import glob, os, shutil
    from safetensors.numpy import load_file, save_file
    from gemport.checkpoint.adapters import match
    from gemport.specs import GemmaSpec
    state = {}
    for shard in sorted(glob.glob(base + "/*.safetensors")):
        state.update(load_file(shard))
    for t, a, b in match(params, GemmaSpec.from_hf(base), lora_spec):
        for module, (A, B) in zip(t.hf_modules, t.to_peft(a, b)):
            key = "model." + module + ".weight"
            state[key] = (state[key].astype(np.float32) + B @ A * lora_spec.scale).astype(state[key].dtype)
    os.makedirs(out)
    save_file(state, out + "/model.safetensors")
    shutil.copy(base + "/config.json", out)
print(json.dumps({"seconds": time.perf_counter() - start, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "base": start_rss}))
"""


def run(who: str, base: Path, adapter: Path, out: Path, rank: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run([sys.executable, "-c", _CHILD, who, str(base), str(adapter), str(out), str(rank)],
                          capture_output=True, text=True, env={"JAX_PLATFORMS": "cpu", **os.environ})
    shutil.rmtree(out, ignore_errors=True)
    if proc.returncode:
        return {"error": proc.stderr.strip().splitlines()[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def write_adapter(path: Path, layers: int, rank: int) -> None:
    rng = np.random.default_rng(0)
    params = {}
    for t in targets(spec_31b(layers), LoraSpec(rank, 2.0 * rank).targets):
        a_shape, b_shape = t.shapes(rank)
        params[t.lora_a] = rng.normal(0, 0.01, a_shape).astype(np.float32)
        params[t.lora_b] = rng.normal(0, 0.01, b_shape).astype(np.float32)
    np.savez(path, **params)


def available_memory() -> int:
    """MemAvailable: free memory plus the page cache the kernel can reclaim."""
    with open("/proc/meminfo") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:"))


def timed_cp(src: Path, dst: Path) -> float:
    shutil.rmtree(dst, ignore_errors=True)
    start = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    os.sync()
    seconds = time.perf_counter() - start
    shutil.rmtree(dst)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "gemport-bench-export")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    available = available_memory()
    print(f"rank {args.rank} on every projection; bf16; available memory {available / GIB:.1f} GiB")
    print(f"{'layers':>6} {'GiB':>6} {'cp s':>6} {'export s':>9} {'x cp':>5} {'peak GiB':>9} "
          f"{'load-all s':>11} {'peak GiB':>9} {'x time':>7} {'x peak':>7}")
    for layers in args.layers:
        base = args.dir / f"ckpt-{layers}"
        if not base.exists():
            write_checkpoint(base, layers)
        adapter = args.dir / f"adapter-{layers}.npz"
        write_adapter(adapter, layers, args.rank)
        nbytes = sum(p.stat().st_size for p in base.glob("*.safetensors"))
        cp = timed_cp(base, args.dir / "copy")
        ours = run("export_merged", base, adapter, args.dir / "out", args.rank)
        if "error" in ours:
            print(f"{layers:>6} export_merged failed: {ours['error']}")
            continue
        row = (f"{layers:>6} {nbytes / GIB:>6.2f} {cp:>6.1f} {ours['seconds']:>9.1f} {ours['seconds'] / cp:>5.2f} "
               f"{ours['peak'] / GIB:>9.2f}")
        # The load-everything merge holds the checkpoint, float32 temporaries and its serialised output.
        if 2.5 * nbytes < available:
            full = run("load_everything", base, adapter, args.dir / "out", args.rank)
            if "error" in full:
                row += f"  load-everything failed: {full['error']}"
            else:
                row += (f" {full['seconds']:>11.1f} {full['peak'] / GIB:>9.2f} "
                        f"{ours['seconds'] / full['seconds']:>7.2f} {ours['peak'] / full['peak']:>7.2f}")
        else:
            row += f"  load-everything skipped: needs ~{2.5 * nbytes / GIB:.0f} GiB"
        print(row, flush=True)
    print("targets: export time <= 2x cp; export peak RSS < 1.5 GiB and flat as layers are added")


if __name__ == "__main__":
    main()
