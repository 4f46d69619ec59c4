"""Test setup: JAX sees 8 simulated CPU devices, so meshes can be built as on a TPU slice.

The TPU tier (tests marked ``tpu``: the chip against the CPU, tests/step/test_step_on_chip.py and
tests/check/test_peers_on_chip.py) runs on a TPU host with
``GEMPORT_TPU=1``: JAX then sees the chip beside the CPU, and only that tier runs (the rest of the suite is the
CPU's); elsewhere, as in CI, the tier is skipped and its recorded figures are checked (tests/test_on_chip_record.py).
"""

import atexit
import json
import os
import platform
import shutil
import tempfile

ON_CHIP = os.environ.get("GEMPORT_TPU") == "1"
if not ON_CHIP:
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
# gemport sft/dpo keep compiled programs in ~/.cache/gemport/xla unless told otherwise: here, in the session's own
# directory, removed at its end.
_COMPILE_CACHE = tempfile.mkdtemp(prefix="gemport-xla-")
atexit.register(shutil.rmtree, _COMPILE_CACHE, ignore_errors=True)
os.environ.setdefault("GEMPORT_COMPILE_CACHE", _COMPILE_CACHE)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "tpu: the TPU tier: runs on a TPU host with GEMPORT_TPU=1, and only there")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if ON_CHIP and "tpu" not in item.keywords:
            item.add_marker(pytest.mark.skip(reason="GEMPORT_TPU=1 runs the TPU tier only"))
        elif not ON_CHIP and "tpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="the TPU tier: GEMPORT_TPU=1 on a TPU host"))


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


@pytest.fixture(scope="module")
def sft_workdir(hf_checkpoint, tmp_path_factory):
    """A tiny Gemma 4 with its tokenizer, a data folder with train/test splits, and a step-0 PEFT adapter: what
    `gemport sft` trains in tests/cli/test_sft_cli.py (``sft_command.write_recipe`` writes its recipe)."""
    import peft
    import torch
    import transformers
    from chats import chats, tokenizer
    from lora_targets import TARGETS

    _, base = hf_checkpoint("gemma4_mesh")
    root = tmp_path_factory.mktemp("sft")
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    tokenizer().save_pretrained(root / "base")
    model.save_pretrained(root / "base")
    (root / "data").mkdir()
    (root / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats(16)))
    (root / "data" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats(5, seed=1)))
    torch.manual_seed(0)
    start = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    with torch.no_grad():  # an adapter as if trained on GPUs: B away from PEFT's zero init
        for name, p in start.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    start.save_pretrained(root / "adapter0")
    return root


@pytest.fixture(scope="module")
def dpo_workdir(hf_checkpoint, tmp_path_factory):
    """A tiny Gemma 3 with its tokenizer, a data folder of three preference records (train.jsonl) and three
    held-out ones (test.jsonl), and a PEFT adapter: what `gemport dpo` trains in tests/run/test_dpo_run.py
    (``dpo_command.write_recipe`` writes its recipe)."""
    import peft
    import torch
    import transformers
    from lora_targets import TARGETS
    from preference_records import RECORDS
    from tiny_tokenizers import GEMMA3_CONTROL, bpe_tokenizer
    from trl.chat_template_utils import gemma3_chat_template

    _, base = hf_checkpoint("gemma3_vllm")
    root = tmp_path_factory.mktemp("dpo")
    tokenizer = bpe_tokenizer(GEMMA3_CONTROL)
    tokenizer.chat_template = gemma3_chat_template
    tokenizer.eos_token = "<end_of_turn>"
    tokenizer.save_pretrained(root / "base")
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    model.save_pretrained(root / "base")
    (root / "data").mkdir()
    (root / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS["conversational"][:3]))
    held_out = [RECORDS["conversational"][i] for i in (3, 0, 1)]
    (root / "data" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held_out))
    torch.manual_seed(0)
    start = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0))
    with torch.no_grad():  # an adapter as if trained by SFT: B away from PEFT's zero init
        for name, p in start.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    start.save_pretrained(root / "adapter0")
    return root


@pytest.fixture(scope="module")
def qlora_base(tmp_path_factory):
    """Factory name -> saved float32 HF checkpoint directory of a ``qlora_configs.QLORA_CONFIGS`` model."""
    import transformers as tf
    from qlora_configs import QLORA_CONFIGS
    from tiny import randomize

    cache = {}

    def make(name):
        if name not in cache:
            cfg = QLORA_CONFIGS[name]
            cfg._attn_implementation = "eager"
            cls = tf.Gemma4ForCausalLM if name == "gemma4" else tf.Gemma3ForCausalLM
            path = tmp_path_factory.mktemp(f"qlora-{name}")
            randomize(cls(cfg)).save_pretrained(path)
            cache[name] = path
        return cache[name]

    return make
