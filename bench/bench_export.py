"""export_merged time and peak RSS vs `cp` and vs a load-everything merge, on 31B-shaped bf16 checkpoints.

For each layer count: a synthetic Gemma 4 31B-shaped checkpoint (bench/synthetic.py) and a random rank-16
adapter on every projection. Each contender runs in a fresh process that reports its own wall time and peak
RSS (ru_maxrss) and CPU seconds; the fastest of --repeats runs is kept, as other work on a shared host
makes single timings noisy. The load-everything
merge reads every shard into memory, adds the deltas and writes one file, as Tunix's generic merge helper
does; it is skipped when it would not fit in memory. Usage:

    python bench/bench_export.py [--layers 2 4 8] [--rank 16] [--repeats 2] [--dir /tmp/gemport-bench-export]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from synthetic import spec_31b, write_checkpoint  # noqa: E402

from gemport.lora import LoraLayout, LoraSpec  # noqa: E402

GIB = 2**30

_CHILD = r"""
import glob, json, os, resource, shutil, sys, time
import numpy as np
from safetensors.numpy import load_file, save_file
from gemport.checkpoint import export_merged
from gemport.lora import LoraLayout, LoraSpec
from gemport.specs import GemmaSpec
who, base, adapter, out, rank = sys.argv[1:6]
params = dict(np.load(adapter))
lora_spec = LoraSpec(int(rank), 2.0 * int(rank))
before = resource.getrusage(resource.RUSAGE_SELF)
start = time.perf_counter()
if who == "export_merged":
    export_merged(params, out, base_dir=base, lora_spec=lora_spec, max_shard_size="2GB")
else:
    state = {}
    for shard in sorted(glob.glob(base + "/*.safetensors")):
        state.update(load_file(shard))
    for t, a, b in LoraLayout(GemmaSpec.from_hf(base), lora_spec).match(params):
        for module, (A, B) in zip(t.hf_modules, t.to_peft(a, b)):
            key = "model." + module + ".weight"
            state[key] = (state[key].astype(np.float32) + B @ A * lora_spec.scale).astype(state[key].dtype)
    os.makedirs(out)
    save_file(state, out + "/model.safetensors")
    shutil.copy(base + "/config.json", out)
seconds = time.perf_counter() - start
after = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"seconds": seconds, "peak": after.ru_maxrss * 1024, "base": before.ru_maxrss * 1024,
                  "cpu": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime}))
"""


def run(who: str, base: Path, adapter: Path, out: Path, rank: int, repeats: int) -> dict:
    """The fastest of ``repeats`` runs in fresh processes: a shared host makes single timings noisy."""
    best = None
    for _ in range(repeats):
        shutil.rmtree(out, ignore_errors=True)
        proc = subprocess.run([sys.executable, "-c", _CHILD, who, str(base), str(adapter), str(out), str(rank)],
                              capture_output=True, text=True, env={"JAX_PLATFORMS": "cpu", **os.environ})
        shutil.rmtree(out, ignore_errors=True)
        if proc.returncode:
            return {"error": proc.stderr.strip().splitlines()[-1]}
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        best = result if best is None or result["seconds"] < best["seconds"] else best
    return best


def write_adapter(path: Path, layers: int, rank: int) -> None:
    rng = np.random.default_rng(0)
    params = {}
    for name, shape in LoraLayout(spec_31b(layers), LoraSpec(rank, 2.0 * rank)).shapes().items():
        params[name] = rng.normal(0, 0.01, shape).astype(np.float32)
    np.savez(path, **params)


def available_memory() -> int:
    """MemAvailable: free memory plus the page cache the kernel can reclaim."""
    with open("/proc/meminfo") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:"))


def timed_cp(src: Path, dst: Path, repeats: int) -> dict:
    """Wall and CPU seconds of the fastest of ``repeats`` ``cp -r`` runs, synced to disk."""
    best = None
    for _ in range(repeats):
        shutil.rmtree(dst, ignore_errors=True)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
        os.sync()
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        result = {"seconds": time.perf_counter() - start,
                  "cpu": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime}
        best = result if best is None or result["seconds"] < best["seconds"] else best
        shutil.rmtree(dst)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2, help="runs per contender; the fastest is reported")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "gemport-bench-export")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    available = available_memory()
    print(f"rank {args.rank} on every projection; bf16; available memory {available / GIB:.1f} GiB")
    print(f"{'layers':>6} {'GiB':>6} {'cp s':>6} {'cpu s':>6} {'export s':>9} {'cpu s':>6} {'x cp':>5} "
          f"{'peak GiB':>9} {'imports':>8} {'load-all s':>11} {'peak GiB':>9} {'x time':>7} {'x peak':>7}")
    for layers in args.layers:
        base = args.dir / f"ckpt-{layers}"
        if not base.exists():
            write_checkpoint(base, layers)
        adapter = args.dir / f"adapter-{layers}.npz"
        write_adapter(adapter, layers, args.rank)
        nbytes = sum(p.stat().st_size for p in base.glob("*.safetensors"))
        cp = timed_cp(base, args.dir / "copy", args.repeats)
        ours = run("export_merged", base, adapter, args.dir / "out", args.rank, args.repeats)
        if "error" in ours:
            print(f"{layers:>6} export_merged failed: {ours['error']}")
            continue
        row = (f"{layers:>6} {nbytes / GIB:>6.2f} {cp['seconds']:>6.1f} {cp['cpu']:>6.1f} {ours['seconds']:>9.1f} "
               f"{ours['cpu']:>6.1f} {ours['seconds'] / cp['seconds']:>5.2f} {ours['peak'] / GIB:>9.2f} "
               f"{ours['base'] / GIB:>8.2f}")
        # The load-everything merge holds the checkpoint, float32 temporaries and its serialised output.
        if 2.5 * nbytes < available:
            full = run("load_everything", base, adapter, args.dir / "out", args.rank, 1)
            if "error" in full:
                row += f"  load-everything failed: {full['error']}"
            else:
                row += (f" {full['seconds']:>11.1f} {full['peak'] / GIB:>9.2f} "
                        f"{ours['seconds'] / full['seconds']:>7.2f} {ours['peak'] / full['peak']:>7.2f}")
        else:
            row += f"  load-everything skipped: needs ~{2.5 * nbytes / GIB:.0f} GiB"
        print(row, flush=True)
    print("imports: the process's RSS after importing jax, gemport and loading the adapter, before the export")
    print("targets: export time <= 2x cp; export peak RSS < 1.5 GiB and flat as layers are added")


if __name__ == "__main__":
    main()
