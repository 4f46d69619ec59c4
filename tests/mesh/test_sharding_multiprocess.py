"""Two processes of four CPU devices each, joined with jax.distributed on localhost, build one 8-device
mesh with make_mesh and load a checkpoint where each process reads only the slices its devices hold."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

from gemport.checkpoint.load import load_hf
from mesh24 import mesh24_causal_lm
from repo_paths import ROOT
from ports import free_port

WORKER = """
import json, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, pid, ckpt = sys.argv[1], int(sys.argv[2]), sys.argv[3]
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=pid)
import numpy as np
from flax import nnx
from gemport.checkpoint.load import load_hf
from gemport.mesh import make_mesh
from gemport.specs import GemmaSpec

mesh = make_mesh(GemmaSpec.from_hf(ckpt), fsdp=2, tp=4)
state = load_hf(ckpt, mesh=mesh)
shards = {
    ".".join(map(str, path)): [
        (s.device.process_index, [[i.start, i.stop] for i in s.index], np.asarray(s.data).tolist())
        for s in var.get_value().addressable_shards
    ]
    for path, var in nnx.to_flat_state(state)
}
report = {"devices": jax.device_count(), "local": jax.local_device_count(), "mesh": dict(mesh.shape), "shards": shards}
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("mesh24_mp")
    mesh24_causal_lm().save_pretrained(path)
    return path


def test_two_processes_load_only_their_slices(ckpt, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    port = free_port()
    logs = [(tmp_path / f"out{pid}", tmp_path / f"err{pid}") for pid in (0, 1)]
    # Output goes to files: a full pipe would block one worker, and the other then waits for it at shutdown.
    procs = []
    for pid, (out, err) in enumerate(logs):
        with out.open("w") as stdout, err.open("w") as stderr:
            cmd = [sys.executable, str(script), str(port), str(pid), str(ckpt)]
            procs.append(subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr))
    try:
        for proc in procs:
            proc.wait(timeout=300)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    reports = []
    for proc, (out, err) in zip(procs, logs):
        assert proc.returncode == 0, err.read_text()[-3000:]
        reports.append(json.loads(out.read_text().strip().splitlines()[-1]))

    full = {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(load_hf(ckpt))}
    for pid, report in enumerate(reports):
        assert (report["devices"], report["local"], report["mesh"]) == (8, 4, {"fsdp": 2, "tp": 4})
        for path, shards in report["shards"].items():
            assert len(shards) == 4 and {owner for owner, _, _ in shards} == {pid}, path
            for _, index, data in shards:
                expected = full[path][tuple(slice(a, b) for a, b in index)]
                np.testing.assert_array_equal(np.asarray(data, expected.dtype).reshape(expected.shape), expected)
    # The embedding (V, D) is sharded (tp, fsdp): each process holds, and so read, only its half of D.
    halves = [{tuple(index[1]) for _, index, _ in r["shards"]["embedder.input_embedding"]} for r in reports]
    assert sorted(halves) == [{(0, 16)}, {(16, 32)}]
