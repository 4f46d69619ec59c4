"""Test setup: JAX sees 8 simulated CPU devices, so meshes can be built as on a TPU slice."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# On a busy 2-core machine one simulated device can reach an all-reduce long after the others: allow it.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_cpu_collective_call_terminate_timeout_seconds=900"
).strip()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """Factory ``(config name, kind) -> (torch model, saved directory)``, each built and saved once per session.

    ``kind`` is ``"causal"`` (``Gemma*ForCausalLM``) or ``"conditional"`` (``Gemma*ForConditionalGeneration``
    with a tiny vision tower). Config names are those of ``tests/tiny.py``.
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
