"""Test setup: JAX sees 8 simulated CPU devices, so meshes can be built as on a TPU slice."""

import os
import platform

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# float32 results depend on how a reduction is split over threads and vectorised, so what the machine would pick
# is pinned here, before torch and jax load: one thread for torch (OpenMP, MKL) and for XLA's Eigen matmuls, and
# AVX2 code paths for torch's kernels, oneDNN, MKL and XLA's codegen (AVX-512 kernels, chosen where the CPU has
# them, sum in another order; every x86-64 CPU these tests run on has AVX2). The same float32 noise then on every
# machine; the tolerances do not rely on it (each comes from a floor the test measures), the reproducibility of a
# failure does. A variable set in the environment, or an XLA flag in XLA_FLAGS, overrides the pin.
PINNED_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
PINNED_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false"
if platform.machine().lower() in ("x86_64", "amd64"):
    PINNED_ENV |= {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    PINNED_XLA_FLAGS += " --xla_cpu_max_isa=AVX2"
for name, value in PINNED_ENV.items():
    os.environ.setdefault(name, value)
# On a busy 2-core machine one simulated device can reach an all-reduce long after the others: allow it.
# XLA takes the last of repeated flags, so the user's come after the pins.
os.environ["XLA_FLAGS"] = " ".join((
    PINNED_XLA_FLAGS, os.environ.get("XLA_FLAGS", ""),
    "--xla_force_host_platform_device_count=8 --xla_cpu_collective_call_terminate_timeout_seconds=900",
)).strip()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """Factory ``(config name, kind) -> (torch model, saved directory)``, each built and saved once per session.

    ``kind`` is ``"causal"`` (``Gemma*ForCausalLM``) or ``"conditional"`` (``Gemma*ForConditionalGeneration``
    with a tiny vision tower). Config names are those of ``tests/helpers/tiny.py``.
    """
    from tiny import causal_lm, conditional_generation

    cache = {}

    def make(name: str, kind: str = "causal"):
        if (name, kind) not in cache:
            model = causal_lm(name) if kind == "causal" else conditional_generation(name)
            path = tmp_path_factory.mktemp(f"{name}-{kind}")
            model.save_pretrained(path)
            cache[name, kind] = (model, path)
        return cache[name, kind]

    return make


@pytest.fixture(scope="session")
def real_checkpoint(tmp_path_factory):
    """Factory ``(config name, dtype="float32") -> (torch model, saved directory)``: a tiny model of
    ``tests/helpers/tiny.py`` with a real checkpoint's magnitudes (``tiny.real_magnitudes``: logits of order 100, norm
    gains to tens, large-norm embedding rows), saved in ``dtype`` (``"bfloat16"`` as Gemma checkpoints ship);
    each built once per session."""
    import torch

    from tiny import causal_lm, real_magnitudes

    cache = {}

    def make(name: str, dtype: str = "float32"):
        if (name, dtype) not in cache:
            model = real_magnitudes(causal_lm(name)).to(getattr(torch, dtype))
            path = tmp_path_factory.mktemp(f"{name}-real-{dtype}")
            model.save_pretrained(path)
            cache[name, dtype] = (model, path)
        return cache[name, dtype]

    return make
