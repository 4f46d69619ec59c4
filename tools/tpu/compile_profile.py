"""Where a step's compile spends its time: XLA's passes, ranked by their own (self) time, from a profile of the compile.

The step is ``bench/bench_tpu.py``'s case (the trainer ``SFTRun`` builds, abstract weights), compiled for the
first local device (on the lent TPU machine: libtpu for its chip) or, given a slice name, for that slice's first
chip by libtpu on this host (compile-only). JAX's profiler records XLA's pass pipeline as trace events on the
threads that compile. Prints the phases (tracing, lowering, compiling) and the passes taking the most CPU (an
event's duration less its children's, summed over the threads: code generation runs on several at once, so the
sum passes the compile's wall time); appends them as a JSON line to ``OUT/compile_profile.jsonl``
(``bench/compile_profile.jsonl`` holds the recorded ones).

    source .whl-tpu/setup.sh && python3 tools/tpu/compile_profile.py 1b-26 $OUT        # on the TPU machine
    python3 tools/tpu/compile_profile.py 1b-26 /tmp/profile v5e-1                      # libtpu, compile-only here
"""

import collections
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))


def cpu_by_pass(path: Path) -> collections.Counter:
    """Nanoseconds of self time (duration less children's on its thread) per event name in the profile at
    ``path``, over every thread, Python's frames (named "$file:line function") left out. The call that waits on
    libtpu's threads (``PjRtCApiClient::CompileAndLoad``) therefore counts the compile's wall time."""
    from jax.profiler import ProfileData

    cpu = collections.Counter()
    for plane in ProfileData.from_file(str(path)).planes:
        for line in plane.lines:
            events = sorted((e for e in line.events if not e.name.startswith("$")),
                            key=lambda e: (e.start_ns, -e.duration_ns))
            enclosing = []  # (name, end) of the events the current one lies within, innermost last
            for event in events:
                while enclosing and enclosing[-1][1] <= event.start_ns:
                    enclosing.pop()
                if enclosing:  # a child's time is its own, not its parent's
                    cpu[enclosing[-1][0]] -= event.duration_ns
                cpu[event.name] += event.duration_ns
                enclosing.append((event.name, event.start_ns + event.duration_ns))
    return cpu


def main(case: str, out: Path, tpu: str | None = None) -> None:
    import jax

    import bench_tpu
    from gemport.mesh import make_mesh
    from gemport.mesh.tpu import slice_devices
    from gemport.plan.compiled import trace_step

    preset, layers, rows, seq_len, loss, remat = bench_tpu.CASES[case]
    spec = bench_tpu.spec_of(preset, layers)
    mesh = make_mesh(spec, fsdp=1, tp=1, devices=(slice_devices(tpu) if tpu else jax.devices())[:1])
    trainer = bench_tpu.abstract_trainer(spec, loss, remat)
    phases = {}
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            start = time.perf_counter()
            traced = trace_step(trainer, mesh, rows, seq_len)
            phases["tracing_s"] = time.perf_counter() - start
            start = time.perf_counter()
            lowered = traced.lower()
            phases["lowering_s"] = time.perf_counter() - start
            start = time.perf_counter()
            lowered.compile()
            phases["compiling_s"] = time.perf_counter() - start
        (profile,) = Path(trace_dir).rglob("*.xplane.pb")
        cpu = cpu_by_pass(profile)
    passes = [dict(name=name, cpu_s=round(ns / 1e9, 2)) for name, ns in cpu.most_common(30)]
    result = dict(bench_tpu.versions(), case=case, target=tpu or jax.devices()[0].device_kind, **phases,
                  passes=passes)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "compile_profile.jsonl").open("a") as f:
        f.write(json.dumps(result) + "\n")
    print({k: round(v, 1) for k, v in phases.items()})
    print("CPU seconds by pass:")
    for p in passes:
        print(f"{p['cpu_s']:8.2f}  {p['name']}")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), *sys.argv[3:4])
