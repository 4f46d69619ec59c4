"""The trained step on a TPU chip: step time, tokens/s, MFU, peak HBM and compile seconds of every case of issue 44's
point 1, each in its own process (the chip's peak memory is per process; a case out of HBM does not stop the rest).

The step is the one ``SFTRun.train()`` runs (``HFPeftTrainer.jitted_train_step`` of ``plan.compiled.step_trainer``:
TRL's defaults, HF's AdamW with clipping, decoder remat, so the decoder scanned in blocks where it has two or more),
bf16, LoRA r=16 on all seven projections, random weights, rows of one segment. MFU is ``bench_train``'s count
(``4 x`` the weights a token passes through + attention) over the chip's bf16 peak; a model measured at two depths
also gets its decoder layers' own MFU (the extra layers' FLOPs over the extra time). ``compile_s`` is the first
call's time less one step (tracing and compiling); ``matmul`` is the chip's rate on a plain 8192^3 bf16 product;
``compile-60`` compiles the 60-layer Gemma 4 31B step for a v5p-8 with libtpu on this host (``bench_compile``).
Usage, on the TPU machine (``source .whl-tpu/setup.sh`` first; ``make bench-tpu`` does both):

    python bench/bench_tpu.py --record bench/tpu.jsonl            # every case, in order
    python bench/bench_tpu.py --cases matmul 1b-26 --record F     # some

and on the CPU host, the steps' compiled peaks for one v5e (libtpu compile-only) beside their memory plans:

    python bench/bench_tpu.py --compile-only --cases 1b-26 31b-4 --record bench/tpu_compiled.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

GiB = 2**30

CASES = {
    # name: (preset, layers or None for all, rows, seq_len, loss, remat); 8192 tokens per micro-batch, as issue 44
    # asks
    "1b-26": ("gemma3-1b", None, 4, 2048, "fast", "decoder"),
    "1b-14": ("gemma3-1b", 14, 4, 2048, "fast", "decoder"),
    "31b-4": ("gemma4-31b", 4, 2, 4096, "fast", "decoder"),
    "31b-5": ("gemma4-31b", 5, 2, 4096, "fast", "decoder"),
    "1b-26-projections": ("gemma3-1b", None, 4, 2048, "fast", "projections"),
    "1b-14-projections": ("gemma3-1b", 14, 4, 2048, "fast", "projections"),
    "31b-4-projections": ("gemma4-31b", 4, 2, 4096, "fast", "projections"),
    "31b-3-projections": ("gemma4-31b", 3, 2, 4096, "fast", "projections"),
    "1b-26-fit": ("gemma3-1b", None, 4, 2048, "fast", "fit"),
    "1b-26-fit-8x2048": ("gemma3-1b", None, 8, 2048, "fast", "fit"),
    "e4b": ("gemma4-e4b", None, 2, 4096, "fast", "decoder"),
    "e4b-2x2048": ("gemma4-e4b", None, 2, 2048, "fast", "decoder"),
    "1b-26-tunix-2x1024": ("gemma3-1b", None, 2, 1024, "tunix", "decoder"),
    "1b-26-tunix-2x2048": ("gemma3-1b", None, 2, 2048, "tunix", "decoder"),
}
"""The step's cases: a Gemma preset cut to ``layers`` (its own pattern), ``rows`` x ``seq_len`` tokens, gemport's
fast step (segment attention, chunked loss) or Tunix's own loss (``step.tunix_loss``: its [B, T, N, T] scores and
[B, T, V] logits did not fit a v5e at 4 x 2048 tokens, 19.2 GB; 2 x 1024 did), and the remat (``step.remat``:
"decoder" recomputes each layer whole; "projections" keeps the adapted projections' products; "fit" is what
``gradient_checkpointing: true`` trains on a TPU, the first of ``step.fit.FIT`` libtpu compiles within the chip's
HBM, chosen by the first call as the trainer's first step chooses: at 8 x 2048 tokens 1B's 26 layers' products
alone would take about 15 GB)."""

LORA = dict(rank=16, alpha=32)
"""Every case's LoRA: r=16 on all seven projections (``LoraSpec``'s default targets)."""

DEPTHS = {"1b": ("1b-14", "1b-26"), "31b": ("31b-4", "31b-5"),
          "1b projections": ("1b-14-projections", "1b-26-projections"),
          "31b projections": ("31b-3-projections", "31b-4-projections")}
"""Pairs of depths of one model, both scanned, whose difference gives the decoder layers' own MFU: Gemma 3 1B's
two blocks of six, Gemma 4 31B's fifth layer (its first five are sliding, one scanned block each; a global layer
makes six, one block, and twelve do not fit a v5e's 16 GB), or under "projections" its fourth (five layers' kept
products did not fit: 16.33 GB of temporaries)."""

ORDER = ("matmul", "1b-26", "31b-4", "1b-26-projections", "31b-4-projections", "1b-14", "31b-5",
         "1b-14-projections", "31b-3-projections", "1b-26-fit", "1b-26-fit-8x2048", "1b-26-tunix-2x1024", "e4b",
         "e4b-2x2048", "1b-26-tunix-2x2048", "compile-60")


def versions() -> dict:
    import jax

    out = {"device_kind": jax.devices()[0].device_kind, "jax": jax.__version__,
           "date": datetime.date.today().isoformat()}
    for package in ("jaxlib", "libtpu", "google-tunix", "qwix"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return out


def spec_of(preset: str, layers: int | None):
    from gemport.specs import GemmaSpec

    spec = GemmaSpec.preset(preset)
    if layers is None:
        return spec
    return dataclasses.replace(spec, num_layers=layers, layer_types=spec.layer_types[:layers])


def drawn(graph, mesh, scale: float):
    """``graph`` (an abstract model or optimizer) with its values on ``mesh`` as the run places them, drawn in one
    compiled program: normal x ``scale`` (0: zeros, an optimizer's fresh state), one draw per shape scaled by up to
    2x per array. Initialised op by op, as Tunix and optax do, 31B's widths took minutes per layer on the chip, each
    new shape one more compile."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from gemport.plan.compiled import _placed

    graphdef, state = nnx.split(_placed(graph, mesh))
    shapes, treedef = jax.tree.flatten(state)

    # One draw per shape, each array of that shape a distinct multiple of it: a draw per array (626 for Gemma 3 1B)
    # took a minute to compile on the CPU and four before the step on the chip.
    def random(s):
        return scale and jnp.issubdtype(s.dtype, jnp.floating)

    kinds = sorted({(s.shape, str(s.dtype)) for s in shapes if random(s)})

    def draw(key):
        keys = dict(zip(kinds, jax.random.split(key, len(kinds))))
        normal = {kind: jax.random.normal(keys[kind], *kind) for kind in kinds}
        return [(scale * (1 + i / len(shapes))) * normal[s.shape, str(s.dtype)]
                if random(s) else jnp.zeros(s.shape, s.dtype)
                for i, s in enumerate(shapes)]

    values = jax.jit(draw, out_shardings=[s.sharding for s in shapes])(jax.random.key(0))
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, values))


def progress(message: str) -> None:
    print(f"# {message}", file=sys.stderr, flush=True)


def matmul() -> dict:
    import jax
    import jax.numpy as jnp

    n = 8192
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    f = jax.jit(lambda a: a @ a)
    f(a).block_until_ready()
    times = []
    for _ in range(10):
        start = time.perf_counter()
        f(a).block_until_ready()
        times.append(time.perf_counter() - start)
    return dict(ms=min(times) * 1e3, tflops=2 * n**3 / min(times) / 1e12)


def loss_fn(loss: str):
    from gemport.step import segment_loss, tunix_loss

    return segment_loss if loss == "fast" else tunix_loss


def abstract_trainer(spec, loss: str, remat: str):
    """The trainer ``SFTRun`` builds (TRL's defaults) for an abstract bf16 model of ``spec`` with the cases' LoRA,
    the loss ``loss`` ("fast" or "tunix") and the remat ``remat``."""
    import jax.numpy as jnp

    from gemport.lora import LoraSpec
    from gemport.plan.compiled import step_trainer
    from gemport.run.model import lora_model

    model = lora_model(spec, LoraSpec(**LORA), param_dtype=jnp.bfloat16, remat=remat, abstract=True)
    return step_trainer(model, {"gradient_checkpointing": True}, loss_fn=loss_fn(loss))


def step(preset: str, layers: int | None, rows: int, seq_len: int, loss: str, remat: str, steps: int = 5,
         profile: Path | None = None) -> dict:
    import jax
    from bench_train import batch_arrays
    from flops import flops_per_token, peak_tflops

    from gemport.mesh import make_mesh
    from gemport.plan.compiled import Compiled
    from gemport.plan.flops import product_flops
    from gemport.step.fit import FIT, first_fitting

    start = time.perf_counter()
    spec = spec_of(preset, layers)
    device = jax.devices()[0]
    mesh = make_mesh(spec, fsdp=1, tp=1, devices=[device])
    remats = FIT if remat == "fit" else (remat,)
    trainer = abstract_trainer(spec, loss, remats[0])
    model, optimizer = drawn(trainer.model, mesh, 0.02), drawn(trainer.optimizer, mesh, 0.0)
    batch = batch_arrays(rows, seq_len, spec.vocab, mesh)
    train_step = trainer.jitted_train_step()  # traced again for a model whose remat changed
    progress(f"model and optimizer on the chip after {time.perf_counter() - start:.0f} s")
    times = []
    with jax.set_mesh(mesh):
        for _ in range(steps + 1):
            start = time.perf_counter()
            if not times:  # the first call takes the first remat libtpu compiles, as the trainer's (step.fit)
                (out, _, _), took, refusals = first_fitting(model, remats,
                                                            lambda: train_step(model, optimizer, batch))
                progress(f"remat {took}" + "".join(f"; {r}" for r in refusals))
            else:
                out, _, _ = train_step(model, optimizer, batch)
            out.block_until_ready()
            times.append(time.perf_counter() - start)
            progress(f"call {len(times)}: {times[-1]:.1f} s")
        # The program the calls ran (JAX's cache gives it back without compiling again): its peak as XLA
        # compiled it for this chip, which the runtime's peak_bytes_in_use leaves the temporaries out of.
        traced = train_step.trace(model, optimizer, batch)
        ran = Compiled.of(traced.lower().compile(), rows * seq_len, product_flops(traced.traced.jaxpr))
        if profile is not None:
            profile.mkdir(parents=True, exist_ok=True)
            with jax.profiler.trace(str(profile)):
                train_step(model, optimizer, batch)[0].block_until_ready()
    seconds = min(times[1:])
    tokens = rows * seq_len
    flops = flops_per_token(spec, seq_len)
    peak = peak_tflops(device.device_kind)
    return dict(layers=spec.num_layers, rows=rows, seq_len=seq_len, loss=loss, remat=remat, took=took,
                refused=refusals, ms=seconds * 1e3,
                tokens_per_s=tokens / seconds, flops_per_token=flops,
                mfu=tokens / seconds * flops / (peak * 1e12) if peak else None,
                peak_hbm_gib=(device.memory_stats() or {}).get("peak_bytes_in_use", 0) / GiB,
                compiled_gib=ran.peak_bytes / GiB, temp_gib=ran.temp_bytes / GiB,
                compile_s=times[0] - seconds, final_loss=float(out))


def planned(name: str):
    """The memory plan (``gemport.memory_plan``, one v5e) of case ``name``'s step."""
    from gemport.lora import LoraSpec
    from gemport.plan import memory_plan

    preset, layers, rows, seq_len, loss, remat = CASES[name]
    return memory_plan(spec_of(preset, layers), 1, 1, lora_spec=LoraSpec(**LORA), hbm_bytes="v5e", batch=rows,
                       seq_len=seq_len, remat=remat, loss_fn=loss_fn(loss))


def compiled(name: str) -> dict:
    """Case ``name``'s step compiled for one v5e by libtpu on this host (compile-only: nothing runs), its peak
    from XLA's memory analysis (deterministic, unlike the chip's runtime counter, which leaves out the program's
    temporaries), beside its memory plan."""
    import jax

    jax.config.update("jax_platforms", "cpu")  # libtpu compiles for the chip; nothing runs
    from gemport.mesh import make_mesh
    from gemport.mesh.tpu import slice_devices
    from gemport.plan.compiled import compile_step

    preset, layers, rows, seq_len, loss, remat = CASES[name]
    spec = spec_of(preset, layers)
    mesh = make_mesh(spec, fsdp=1, tp=1, devices=slice_devices("v5e-1"))
    peak = compile_step(abstract_trainer(spec, loss, remat), mesh, rows, seq_len).peak_bytes
    return dict(target="v5e-1", compiled_gib=peak / GiB, planned_gib=planned(name).total_bytes / GiB,
                jax=jax.__version__, libtpu=metadata.version("libtpu"), date=datetime.date.today().isoformat())


def compile_60() -> dict:
    import bench_compile
    import jax

    jax.config.update("jax_platforms", "cpu")  # libtpu compiles for the slice; nothing runs on the chip

    # On the TPU host or this one: which, by its cores (libtpu's compiler runs on the host's CPU).
    return dict(bench_compile.compile_seconds(60, 1024, "v5p-8", scanned=True), host_cpus=os.cpu_count())


def run_case(name: str, compile_only: bool = False, profile: Path | None = None) -> dict:
    import jax

    from gemport.step.attention import SPLASH_BLOCKS

    if compile_only:
        return dict(compiled(name), splash_blocks=SPLASH_BLOCKS)
    if name != "compile-60" and jax.default_backend() != "tpu":
        raise SystemExit(f"bench_tpu measures a TPU chip; this host's JAX has {jax.default_backend()}")
    if name == "matmul":
        return matmul()
    if name == "compile-60":
        return compile_60()
    preset, layers, rows, seq_len, loss, remat = CASES[name]
    return dict(model=preset, **step(preset, layers, rows, seq_len, loss, remat,
                                     profile=profile / name if profile else None), splash_blocks=SPLASH_BLOCKS)


def in_process(name: str, timeout: float, compile_only: bool = False, profile: Path | None = None,
               cache: Path | None = None) -> dict:
    """Case ``name`` in a child process: its result line, or what stopped it (out of HBM, a timeout)."""
    start = time.perf_counter()
    flags = (["--compile-only"] * compile_only + (["--profile", str(profile)] if profile else [])
             + (["--compile-cache", str(cache)] if cache else []))
    try:
        child = subprocess.run([sys.executable, __file__, "--case", name, *flags], capture_output=True, text=True,
                               timeout=timeout)
    except subprocess.TimeoutExpired as e:
        said = [line for line in (e.stderr or b"").decode(errors="replace").splitlines() if line.startswith("# ")]
        return dict(case=name, error=f"timed out after {timeout:.0f} s" + (f" ({said[-1][2:]})" if said else ""))
    lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
    if child.returncode == 0 and lines:
        return dict(case=name, **json.loads(lines[-1]), wall_s=time.perf_counter() - start)
    text = child.stderr + child.stdout
    hbm = [line for line in text.splitlines() if "RESOURCE_EXHAUSTED" in line or "Ran out of memory" in line]
    return dict(case=name, error=("out of HBM: " + hbm[0].strip()[:300]) if hbm else text.strip()[-600:])


def layers_only(results: dict, name: str) -> list[dict]:
    """The decoder layers' own MFU of the model measured at two depths, one of them case ``name``, once both ran
    (the parent holds no chip: the peak is read back from the deeper case's MFU)."""
    out = []
    for model, (low, high) in DEPTHS.items():
        a, b = results.get(low, {}), results.get(high, {})
        if name in (low, high) and a.get("mfu") and b.get("mfu"):
            tokens = b["rows"] * b["seq_len"]
            peak_flops = b["tokens_per_s"] * b["flops_per_token"] / b["mfu"]
            seconds = (b["ms"] - a["ms"]) / 1e3
            out.append(dict(case=f"{model} layers", from_cases=[low, high], layers=b["layers"] - a["layers"],
                            ms=seconds * 1e3, mfu=(b["flops_per_token"] - a["flops_per_token"]) * tokens / seconds
                            / peak_flops, **{k: b[k] for k in ("device_kind", "jax", "libtpu", "date") if k in b}))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(ORDER), choices=ORDER)
    parser.add_argument("--record", type=Path, help="append each result to this JSON lines file")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per case")
    parser.add_argument("--compile-only", action="store_true",
                        help="on the CPU host: compile each step case for one v5e with libtpu and record its "
                             "compiled peak beside its memory plan (bench/tpu_compiled.jsonl)")
    parser.add_argument("--profile", type=Path,
                        help="on the chip: a profile of one more step of each case under this folder (jax.profiler)")
    parser.add_argument("--compile-cache", type=Path,
                        help="on the chip: each case's programs kept in and loaded from this directory "
                             "(gemport.run.compile_cache, as gemport sft keeps them): a case run a second time "
                             "records the compile a rerun pays (cache_loaded: the programs it loaded; "
                             "cache_recalled: the refusals it recalled instead of compiling)")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # the child's
    args = parser.parse_args()
    if args.case:
        use = None
        if args.compile_cache:
            from gemport.run.compile_cache import compile_cache

            use = compile_cache(args.compile_cache)
        result = run_case(args.case, args.compile_only, args.profile)
        if use is not None:
            result["cache_loaded"], result["cache_recalled"] = use.loaded, use.recalled
        print(json.dumps({**result, **versions()}))
        return
    results = {}
    for name in args.cases:
        # compile-only is of the step cases; a fit case's programs are its projections and decoder cases'
        if args.compile_only and (name not in CASES or CASES[name][5] == "fit"):
            continue
        result = in_process(name, args.timeout, args.compile_only, args.profile, args.compile_cache)
        results[name] = result
        lines = [result] + ([] if args.compile_only else layers_only(results, name))
        for line in lines:
            print(json.dumps(line), flush=True)
            if args.record and "error" not in line:  # what stopped a case is printed, not recorded
                with args.record.open("a") as f:
                    f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
