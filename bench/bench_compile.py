"""Compile time of the train step at depth: decoder layers scanned in blocks (``gemport.step.scan``, what trains)
against the same step unrolled (the baseline: ``scanned_decoder`` replaced by the model itself), in one run.

The step is the one ``SFTRun.train()`` runs (``gemport.plan.compiled.compile_step`` of ``step_trainer``) with the
bundled recipe's settings (``examples/sft_verilog.yaml``: LoRA r=8 on all seven projections, 2 rows per
micro-batch, 2 micro-batches, clipping, decoder remat), bf16, Gemma 4 31B's widths and 5 : 1 attention pattern
cut to each depth given, vocabulary 262144. Compiled for this host's CPU (as ``gemport sft --dry-run`` without
``--tpu``) or, with ``--tpu SLICE``, for a TPU slice by libtpu on this host (compile-only, as ``--dry-run --tpu``),
on the mesh the dry run picks. Prints each compile's seconds and peak per device, and the unrolled/scanned ratio
where both ran; ``--record FILE`` appends each as a JSON line.

``python bench/bench_compile.py [--layers 12 24 60] [--unrolled 12 24 60] [--seq-len 1024] [--tpu v5p-8] [--record F]``
(the unrolled baseline runs only at the ``--unrolled`` depths: for a TPU slice, libtpu's unrolled 60-layer compile
takes tens of minutes on this host).
"""

import argparse
import datetime
import json
import os
import sys
import time
from importlib import metadata
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).parent))

import bench_plan_fit  # noqa: E402
import bench_tpu  # noqa: E402

GiB = 2**30


def spec_of(layers: int):
    """Gemma 4 31B at ``layers`` layers, its own pattern (five sliding, one global) cut there."""
    return bench_tpu.spec_of("gemma4-31b", layers)


def planned(record: dict):
    """The memory plan (no compile) of the step a record of ``compile_seconds`` compiled."""
    rows = bench_plan_fit.recipe()[0]["per_device_train_batch_size"]
    return bench_plan_fit.estimate(spec_of(record["layers"]), record["fsdp"], record["tp"], rows, record["seq_len"])


def compile_seconds(layers: int, seq_len: int, tpu: str | None, scanned: bool) -> dict:
    import jax
    import jax.numpy as jnp

    import gemport.step.hf
    from gemport.mesh import make_mesh
    from gemport.mesh.tpu import slice_devices
    from gemport.plan.compiled import compile_step, step_trainer
    from gemport.run.model import lora_model

    spec = spec_of(layers)
    devices = slice_devices(tpu) if tpu else jax.devices()[:1]
    fsdp, tp = bench_plan_fit.mesh_sizes(spec, len(devices))
    args, lora, remat = bench_plan_fit.recipe()
    model = lora_model(spec, lora, remat=remat, param_dtype=jnp.bfloat16)
    mesh = make_mesh(spec, fsdp=fsdp, tp=tp, devices=devices)
    scan = gemport.step.hf.scanned_decoder
    if not scanned:
        gemport.step.hf.scanned_decoder = lambda model: model  # the baseline: the unrolled decoder
    try:
        start = time.perf_counter()
        c = compile_step(step_trainer(model, args), mesh, args["per_device_train_batch_size"], seq_len)
        seconds = time.perf_counter() - start
    finally:
        gemport.step.hf.scanned_decoder = scan
    return dict(target=tpu or "cpu", layers=layers, seq_len=seq_len, fsdp=fsdp, tp=tp, scanned=scanned,
                compile_s=round(seconds, 1), peak_bytes=c.peak_bytes, jax=metadata.version("jax"),
                libtpu=metadata.version("libtpu") if tpu else None, date=datetime.date.today().isoformat())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[12, 24, 60])
    parser.add_argument("--unrolled", type=int, nargs="*", default=[12, 24, 60])
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--tpu", help="a slice to compile for with libtpu (compile-only), e.g. v5p-8")
    parser.add_argument("--record", type=Path)
    args = parser.parse_args()
    results = {}
    for layers in args.layers:
        for scanned in (False, True) if layers in args.unrolled else (True,):
            m = compile_seconds(layers, args.seq_len, args.tpu, scanned)
            results[layers, scanned] = m
            print(f"{m['target']} {layers:3d} layers {'scanned ' if scanned else 'unrolled'}: compile "
                  f"{m['compile_s']:7.1f} s, peak {m['peak_bytes'] / GiB:6.2f} GiB per device", flush=True)
            if args.record:
                with args.record.open("a") as f:
                    f.write(json.dumps(m) + "\n")
        if (layers, False) in results:
            print(f"    unrolled / scanned at {layers} layers: compile "
                  f"{results[layers, False]['compile_s'] / results[layers, True]['compile_s']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
