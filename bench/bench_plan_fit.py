"""The memory plan's estimate (no compile) against what libtpu compiles the train step to, at Gemma 4 31B's widths.

The step is the one ``SFTRun.train()`` runs (``gemport.plan.compiled.compile_step`` of ``step_trainer``) with the
bundled recipe's settings, read from ``examples/sft_verilog.yaml`` (LoRA r=8, alpha 16 on all seven projections, 2
rows per micro-batch, 2 micro-batches, ``max_grad_norm`` 1.0, ``gradient_checkpointing``: decoder remat), bf16, on the mesh
``gemport sft --dry-run --tpu SLICE`` picks (the largest tp that fits), for each slice and row length given:
2 layers (one sliding, one global), vocabulary 262144, compiled for the slice's chips by libtpu on this host
(compile-only; nothing runs). Prints per chip the estimate, the compiled peak and their ratio, and appends each
compiled figure as a JSON line to ``--record`` (with libtpu's version and the date), so that nothing is compiled
twice: ``--from FILE`` reprints the comparison from recorded figures without compiling.

``python bench/bench_plan_fit.py [SLICE:TOKENS[:FSDPxTP] ...] [--layers 2] [--record FILE] [--from FILE]``, e.g.
``v5p-2:4096 v5p-8:8192 v6e-8:4096`` (``v5p-2`` is one v5p chip; ``v5p-8:4096:4x1``: another mesh than the dry
run's). Several minutes and a few GB per compile.
"""

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))

GiB = 2**30
RECIPE = Path(__file__).parent.parent / "examples" / "sft_verilog.yaml"
CASES = ("v5p-2:4096", "v5p-2:8192", "v5p-8:4096", "v5p-8:8192", "v6e-8:4096", "v6e-8:8192")


def recipe():
    """The bundled recipe's ``SFTConfig`` fields, ``LoraSpec`` and remat, as ``gemport sft`` reads them."""
    from gemport.recipe import read
    from gemport.run.sft import lora_spec_of
    from gemport.data.sft import remat_of

    read_ = read(RECIPE)
    return read_.sft, lora_spec_of(read_.lora()), remat_of(read_.sft)


def spec_of(layers: int, vocab: int = 262144):
    from gemport.specs import GemmaSpec

    types = ("sliding", "global") * (layers // 2) + ("global",) * (layers % 2)
    return dataclasses.replace(GemmaSpec.preset("gemma4-31b"), num_layers=layers, layer_types=types, vocab=vocab)


def mesh_sizes(spec, chips: int) -> tuple[int, int]:
    """(fsdp, tp) as ``make_mesh`` picks them without sizes: the largest tp that fits."""
    from gemport.mesh.factory import valid_tp

    tp = max(valid_tp(spec, chips))
    return chips // tp, tp


def estimate(spec, fsdp: int, tp: int, rows: int, seq_len: int):
    """The plan's ``MemoryPlan`` for the case (no compile)."""
    from gemport.plan import memory_plan

    _, lora, remat = recipe()
    return memory_plan(spec, fsdp, tp, lora_spec=lora, batch=rows, seq_len=seq_len, remat=remat,
                       param_dtype="bfloat16")


def compile_case(spec, tpu: str, seq_len: int, dump: str | None = None, mesh: tuple[int, int] | None = None) -> dict:
    import jax.numpy as jnp

    from gemport.mesh import make_mesh
    from gemport.mesh.tpu import slice_devices
    from gemport.plan.compiled import compile_step, step_trainer
    from gemport.run.model import lora_model

    devices = slice_devices(tpu)
    fsdp, tp = mesh or mesh_sizes(spec, len(devices))
    args, lora, remat = recipe()
    model = lora_model(spec, lora, remat=remat, param_dtype=jnp.bfloat16)
    mesh = make_mesh(spec, fsdp=fsdp, tp=tp, devices=devices)
    rows = args["per_device_train_batch_size"]
    start = time.perf_counter()
    options = None
    if dump:  # XLA's buffer assignment and memory-usage report of the step, to read what the peak holds
        options = {"xla_dump_to": f"{dump}/{tpu}-{seq_len}-{spec.num_layers}", "xla_dump_hlo_as_text": True,
                   "xla_dump_hlo_module_re": ".*"}
    c = compile_step(step_trainer(model, args), mesh, rows, seq_len, compiler_options=options)
    return dict(tpu=tpu, seq_len=seq_len, layers=spec.num_layers, rows=rows, fsdp=fsdp, tp=tp,
                argument_bytes=c.argument_bytes, output_bytes=c.output_bytes, temp_bytes=c.temp_bytes,
                alias_bytes=c.alias_bytes, peak_bytes=c.peak_bytes, compile_s=round(time.perf_counter() - start),
                libtpu=metadata.version("libtpu"), jax=metadata.version("jax"),
                date=datetime.date.today().isoformat())


def line(m: dict) -> str:
    spec = spec_of(m["layers"])
    plan = estimate(spec, m["fsdp"], m["tp"], m["rows"], m["seq_len"])
    return (f"{m['tpu']:6s} fsdp={m['fsdp']} tp={m['tp']} {m['layers']} layers {m['rows']} x {m['seq_len']:5d}: "
            f"estimate {plan.total_bytes / GiB:6.2f} GiB, compiled {m['peak_bytes'] / GiB:6.2f} GiB "
            f"(arguments {m['argument_bytes'] / GiB:.2f}, temporaries {m['temp_bytes'] / GiB:.2f}), "
            f"ratio {plan.total_bytes / m['peak_bytes']:.3f}")


def row(m: dict) -> str:
    """``m`` as a row of docs/benchmarks.md's table."""
    plan = estimate(spec_of(m["layers"]), m["fsdp"], m["tp"], m["rows"], m["seq_len"])
    return (f"| {m['tpu']} | fsdp={m['fsdp']} tp={m['tp']} | {m['seq_len']} | {plan.total_bytes / GiB:.2f} GiB | "
            f"{m['peak_bytes'] / GiB:.2f} GiB ({m['argument_bytes'] / GiB:.2f} + {m['temp_bytes'] / GiB:.2f}) | "
            f"{plan.total_bytes / m['peak_bytes']:.3f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", nargs="*", help=f"SLICE:TOKENS (default: {' '.join(CASES)})")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--record", help="append each compiled figure to this JSON-lines file")
    parser.add_argument("--dump", help="write XLA's dumps (buffer assignment, memory-usage report) under this folder")
    parser.add_argument("--from", dest="recorded", help="reprint the comparison from this JSON-lines file")
    parser.add_argument("--markdown", action="store_true", help="with --from: as rows of docs/benchmarks.md's table")
    args = parser.parse_args()
    if args.recorded:
        for text in Path(args.recorded).read_text().splitlines():
            if text.strip():
                print((row if args.markdown else line)(json.loads(text)))
        return
    import jax

    if "JAX_PLATFORMS" not in os.environ:
        jax.config.update("jax_platforms", "cpu")  # the slice's compiler needs no TPU here
    spec = spec_of(args.layers)
    sft, lora, remat = recipe()
    print(f"Gemma 4 31B widths, {args.layers} layers, {RECIPE.name} (LoRA r={lora.rank} x {len(lora.targets)}, "
          f"{sft['per_device_train_batch_size']} rows per micro-batch, remat {remat}, max_grad_norm "
          f"{sft['max_grad_norm']}), libtpu compile-only, per chip", flush=True)
    for case in args.cases or CASES:
        tpu, seq_len, *mesh = case.split(":")
        mesh = tuple(map(int, mesh[0].split("x"))) if mesh else None
        m = compile_case(spec, tpu, int(seq_len), args.dump, mesh)
        if args.record:
            with open(args.record, "a") as f:
                f.write(json.dumps(m) + "\n")
        print(line(m) + f", compiled in {m['compile_s']} s", flush=True)


if __name__ == "__main__":
    main()
