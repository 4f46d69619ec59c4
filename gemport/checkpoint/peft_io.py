"""Qwix LoRA <-> PEFT adapter directories (``adapter_config.json`` + ``adapter_model.safetensors``).

PEFT keys are ``base_model.model.<text prefix><module>.lora_A.weight`` [r, in] and ``.lora_B.weight``
[out, r], e.g. ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``; LoRA on Gemma 4 MoE experts
(``target_parameters``) is saved as ``...layers.0.experts[.base_layer].lora_A.weight`` [E r, in] and
``.lora_B.weight`` [out, r E] (`gemport.lora.experts`).

Gemma 4's k_eq_v global layers have a ``k_proj`` and no ``v_proj``: V is K, so transformers + PEFT give V the
k_proj delta too. vLLM packs q/k/v into one ``qkv_proj``, loads K's weight into both the K and V slices and
applies each projection's LoRA to its own slice only: served as PEFT writes it, V misses the delta. The
adapters written here therefore carry k_proj's factors a second time under ``v_proj`` on those layers (a
*v_proj copy*); vLLM then computes PEFT's function, and PEFT, which has no v_proj module there, ignores them.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import numpy as np

from gemport.specs import names
from gemport.checkpoint.adapters import load_lora
from gemport.checkpoint.hf_dir import HFCheckpoint, resolve_spec
from gemport.checkpoint.load import matched_entries
from gemport.checkpoint.output import atomic_dir, check_output
from gemport.checkpoint.safetensors import SafetensorsFile, TensorSource, write_file
from gemport.errors import CheckpointError, LoraError, MissingTensorError
from gemport.lora import VLLM_RANKS, LoraLayout, LoraParams, LoraSpec
from gemport._src.params import flat_params, lora_state
from gemport.specs import GemmaSpec
from gemport._src.tensors import check_finite, check_tensors

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def export_peft(lora, out_dir: str | Path, *, base_dir: str | Path | None = None, spec: GemmaSpec | None = None,
                lora_spec: LoraSpec | None = None, step: int | None = None,
                base_model_name_or_path: str | None = None) -> Path:
    """Write Qwix LoRA params as a PEFT adapter that ``peft.PeftModel.from_pretrained`` loads onto the HF base
    and vLLM serves as a LoRA request, both computing the Tunix model's function.

    Exact: each projection gets its own ``lora_A`` / ``lora_B`` (a shared ``lora_a`` written for each projection it
    fuses; k_eq_v layers' k_proj copied under v_proj for vLLM); tensors keep the adapter's dtype. Warns when vLLM
    would refuse the adapter or serve it differently. See docs/lora.md#a-peft-adapter.

    Args:
      lora: the LoRA factors, anything `load_lora` reads: `LoraParams`, an nnx model or state, a flat dict, or
        a PeftTrainer Orbax checkpoint path.
      out_dir: the adapter directory to create; must not exist or be empty.
      base_dir: the HF checkpoint the adapter was trained on. Gives the architecture, the module path of its
        text model (``model.`` for ``Gemma*ForCausalLM``, ``model.language_model.`` for
        ``Gemma*ForConditionalGeneration``) and the default ``base_model_name_or_path``.
      spec: the architecture, when no ``base_dir`` is at hand (keys then use ``model.``).
      lora_spec: rank, alpha, targets; default the one ``lora`` carries or recorded beside an Orbax checkpoint.
      step: with an Orbax checkpoint root, the step to export; default the latest.
      base_model_name_or_path: written into ``adapter_config.json`` for PEFT and vLLM to find the base; default
        ``base_dir``'s absolute path.

    Returns:
      The adapter directory's path, resolved, holding ``adapter_model.safetensors`` (under PEFT's keys, each
      adapted projection's ``lora_A.weight`` [r, in] and ``lora_B.weight`` [out, r], and the expert parameters'
      factors with ``lora_spec.parameters``) and ``adapter_config.json``.

    Example (``checkpoint``: a tiny Gemma 3 saved by transformers):

      >>> import json, tempfile
      >>> import numpy as np
      >>> from safetensors.numpy import load_file
      >>> from gemport import GemmaSpec, LoraLayout, LoraSpec, export_peft, load_lora
      >>> lora_spec = LoraSpec(rank=8, alpha=16, targets=("q_proj", "v_proj"))
      >>> shapes = LoraLayout(GemmaSpec.from_hf(checkpoint), lora_spec).shapes()
      >>> lora = load_lora({name: np.ones(shape, np.float32) for name, shape in shapes.items()}, lora_spec=lora_spec)
      >>> tmp = tempfile.TemporaryDirectory()
      >>> out = export_peft(lora, f"{tmp.name}/adapter", base_dir=checkpoint)
      >>> sorted(p.name for p in out.iterdir())
      ['adapter_config.json', 'adapter_model.safetensors']
      >>> config = json.loads((out / "adapter_config.json").read_text())
      >>> config["r"], config["lora_alpha"], sorted(config["target_modules"])
      (8, 16, ['q_proj', 'v_proj'])
      >>> tensors = load_file(out / "adapter_model.safetensors")  # v_proj: lora_A [r, D], lora_B [K * H, r]
      >>> [tensors[f"base_model.model.model.layers.0.self_attn.v_proj.lora_{f}.weight"].shape for f in "AB"]
      [(8, 32), (8, 8)]
      >>> any("k_proj" in key for key in tensors)  # k_proj, a zero slot of the fused kv_einsum, is not written
      False
      >>> tmp.cleanup()
    """
    out = check_output(out_dir, base_dir, lora if isinstance(lora, (str, os.PathLike)) else None)
    spec = resolve_spec(base_dir, spec)
    text_prefix = "model." if base_dir is None else matched_entries(HFCheckpoint(base_dir), spec)[0]
    if base_model_name_or_path is None and base_dir is not None:
        base_model_name_or_path = str(Path(base_dir).resolve())
    params, lora_spec = load_lora(lora, lora_spec=lora_spec, step=step)
    params = flat_params(params)
    layout = LoraLayout(spec, lora_spec)
    copies = _servable_copies(layout, stacklevel=3)
    sources, ranks = [], []
    for adapter, a, b in layout.match(params):
        for module, (A, B) in zip(adapter.hf_modules, adapter.to_peft(a, b)):
            for name in (module, copies.get(module)):
                if name is not None:
                    key = PEFT_PREFIX + text_prefix + name
                    sources.append(_source(key + ".lora_A.weight", A))
                    sources.append(_source(key + ".lora_B.weight", B))
            ranks.append(A.shape[0])
    for adapter, a, b in layout.match_experts(params):
        key = PEFT_PREFIX + text_prefix + adapter.peft_key(lora_spec.parameters)
        A, B = adapter.to_peft(a, b)
        sources += [_source(key + ".lora_A.weight", A), _source(key + ".lora_B.weight", B)]
        ranks.append(adapter.rank)
    top = max(ranks)
    if top not in VLLM_RANKS:
        fits = [r for r in VLLM_RANKS if r > top]
        warnings.warn(
            f"adapter rank {top} is not one of vLLM's max_lora_rank values {VLLM_RANKS}: "
            + (f"serve it with --max-lora-rank {fits[0]} or more" if fits else "vLLM cannot serve it"),
            stacklevel=2,
        )
    with atomic_dir(out) as tmp:
        write_file(tmp / ADAPTER_WEIGHTS, sources)
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(lora_spec.to_peft(base_model_name_or_path), indent=2) + "\n")
    return out


def v_proj_copies(layout: LoraLayout) -> dict[str, str]:
    """``{k_proj module: its v_proj copy}`` of every k_eq_v layer ``layout`` adapts, relative to the text prefix,
    e.g. ``{"layers.5.self_attn.k_proj": "layers.5.self_attn.v_proj"}``: the k_proj that Tunix holds alone in a
    ``k_einsum``, where K is also V."""
    return {
        module: module.removesuffix("k_proj") + "v_proj"
        for adapter in layout
        for module in adapter.hf_modules
        if len(adapter.entry.hf) == 1 and module.endswith(".self_attn.k_proj")
    }


def vllm_misserved(adapter_dir: str | Path, *, base_dir: str | Path | None = None,
                   spec: GemmaSpec | None = None) -> list[str]:
    """The modules of a PEFT adapter that vLLM serves differently from transformers + PEFT: the k_proj of every
    k_eq_v layer without its v_proj copy (or whose rank/alpha patterns give k_proj and v_proj different scales),
    e.g. ``["model.layers.5.self_attn.k_proj"]``; empty when vLLM serves it exactly. `peft_for_vllm` adds the
    copies."""
    directory = Path(adapter_dir)
    layout = LoraLayout(resolve_spec(base_dir, spec), LoraSpec.from_peft(directory / ADAPTER_CONFIG))
    weights = SafetensorsFile(directory / ADAPTER_WEIGHTS)
    prefix = _text_prefix(weights)
    scaled = layout.lora_spec.scale_of
    return [prefix.removeprefix(PEFT_PREFIX) + k for k, v in v_proj_copies(layout).items()
            if f"{prefix}{v}.lora_A.weight" not in weights.tensors or scaled(k) != scaled(v)]


def _servable_copies(layout: LoraLayout, stacklevel: int) -> dict[str, str]:
    """`v_proj_copies` that vLLM computes exactly: vLLM scales a copy by v_proj's rank_pattern/alpha_pattern,
    so where those give k_proj another scale no copy is written, and a warning names the layers."""
    copies, lora_spec = v_proj_copies(layout), layout.lora_spec
    off = [k for k, v in copies.items() if lora_spec.scale_of(k) != lora_spec.scale_of(v)]
    if off:
        warnings.warn(
            f"rank_pattern/alpha_pattern give k_proj and v_proj different scales on the k_eq_v layers of {off}: "
            "vLLM will serve V there without the k_proj delta (transformers + PEFT give V that delta); give "
            "k_proj and v_proj one rank and alpha to serve this adapter on vLLM exactly",
            stacklevel=stacklevel,
        )
    return {k: v for k, v in copies.items() if k not in off}


def _source(name: str, array: np.ndarray) -> TensorSource:
    return TensorSource.from_array(name, lambda: array, array.dtype, array.shape)


def import_peft(adapter_dir: str | Path, *, base_dir: str | Path | None = None,
                spec: GemmaSpec | None = None) -> LoraParams:
    """Read a PEFT LoRA adapter as Qwix LoRA params for the Tunix model of ``spec``, exactly, for training too.

    Each projection keeps its own factors: k_proj and v_proj become the two slices of kv_einsum's separate
    ``lora_a`` (2, D, r) and ``lora_b`` (2, r, K, H), so the model computes PEFT's function with PEFT's
    parameters, and each factor gets PEFT's gradient. Per-module ``rank_pattern`` / ``alpha_pattern`` are
    kept in the spec (each module keeps its own scale); projections of one fused module with different
    ranks are zero-padded to the larger, which stays exact through training.

    Args:
      adapter_dir: the directory PEFT's ``save_pretrained`` wrote.
      base_dir: the HF checkpoint the adapter was trained on; gives the architecture.
      spec: the architecture, when no ``base_dir`` is at hand.

    Returns:
      `LoraParams`: an ``nnx.State`` of ``nnx.LoRAParam`` (``layers.0.attn.kv_einsum.w_lora_a`` ...) and the
      adapter's spec, for ``apply_lora(model, spec, lora)``, `save_lora` or the exports.

    A v_proj copy on a k_eq_v layer (what `export_peft` and `peft_for_vllm` write for vLLM) is accepted when it
    equals its k_proj's factors bit for bit; PEFT ignores it, and so does the import.

    Raises:
      LoraError: a config Qwix cannot reproduce, NaN/Inf weights, or a v_proj copy that differs from its k_proj.
      MissingTensorError: an adapter tensor the targets need is absent.
      UnexpectedTensorError: an adapter tensor outside the text model's targets (e.g. a vision tower's).
      ShapeMismatchError: an adapter tensor's shape does not fit the base; names the tensor.
    """
    directory = Path(adapter_dir)
    spec = resolve_spec(base_dir, spec)
    for file in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (directory / file).is_file():
            raise CheckpointError(f"{directory}: no {file}; pass a PEFT adapter directory saved by save_pretrained")
    lora_spec = LoraSpec.from_peft(directory / ADAPTER_CONFIG)
    weights = SafetensorsFile(directory / ADAPTER_WEIGHTS)
    prefix = _text_prefix(weights)
    layout = LoraLayout(spec, lora_spec)

    keys = {adapter: [[f"{prefix}{m}.lora_{x}.weight" for x in "AB"] for m in adapter.hf_modules]
            for adapter in layout}
    wanted = {}
    for adapter, pairs in keys.items():
        out_size, in_size = adapter.entry.hf_shape
        for (key_a, key_b), rank in zip(pairs, adapter.peft_ranks):
            wanted |= {key_a: (rank, in_size), key_b: (out_size, rank)}
    expert_keys = {adapter: [f"{prefix}{adapter.peft_key(lora_spec.parameters)}.lora_{x}.weight" for x in "AB"]
                   for adapter in layout.experts}
    for adapter, keys_ab in expert_keys.items():
        wanted |= dict(zip(keys_ab, adapter.peft_shapes))
    copies = _checked_copies(weights, prefix, layout)
    check_tensors(
        {k: info.shape for k, info in weights.tensors.items() if k not in copies},
        wanted,
        source=str(weights.path),
        fix=f"the adapter is not for this {spec.family} text model with the targets and ranks of its "
            f"adapter_config.json ({list(lora_spec.targets)}); Tunix cannot carry adapters on other modules "
            "(vision/audio towers) or another model's layers",
    )
    flat = {}
    for adapter, pairs in keys.items():
        factors = [tuple(_tensor(weights, key) for key in pair) for pair in pairs]
        for name, value in zip((adapter.lora_a, adapter.lora_b), adapter.from_peft(factors)):
            flat[name] = value
    for adapter, pair in expert_keys.items():
        flat |= dict(zip((adapter.lora_a, adapter.lora_b), adapter.from_peft(*(_tensor(weights, k) for k in pair))))
    return LoraParams(lora_state(flat), lora_spec)


def _checked_copies(weights: SafetensorsFile, prefix: str, layout: LoraLayout) -> set[str]:
    """The keys of the v_proj copies present in ``weights``, each checked to equal its k_proj's tensor."""
    keys = set()
    for k, v in v_proj_copies(layout).items():
        pairs = [(f"{prefix}{v}.lora_{x}.weight", f"{prefix}{k}.lora_{x}.weight") for x in "AB"]
        present = [key for key, _ in pairs if key in weights.tensors]
        if not present:
            continue
        for key, of in pairs:
            if key not in weights.tensors:
                raise MissingTensorError(
                    f"{weights.path}: {present[0]!r} without {key!r}: a v_proj copy on a k_eq_v layer needs both "
                    f"factors of {of.rsplit('.', 2)[0]!r}; remove it, or add the missing factor"
                )
            copy, original = weights.array(key), weights.array(of)
            if copy.dtype != original.dtype or copy.shape != original.shape or copy.tobytes() != original.tobytes():
                raise LoraError(
                    f"{weights.path}: {key!r} ({copy.dtype} {list(copy.shape)}) is not a copy of {of!r} "
                    f"({original.dtype} {list(original.shape)}): layer {k.split('.')[1]} is k_eq_v (V is K, no "
                    "v_proj), where a v_proj can only repeat k_proj's factors for vLLM; remove it (`gemport "
                    "peft-for-vllm` then writes the copy)"
                )
            keys.add(key)
    return keys


def peft_for_vllm(adapter_dir: str | Path, out_dir: str | Path, *, base_dir: str | Path | None = None,
                  spec: GemmaSpec | None = None) -> tuple[Path, list[str]]:
    """Copy a PEFT adapter made elsewhere (e.g. PEFT's ``save_pretrained`` after GPU training), adding the v_proj
    copies vLLM needs on k_eq_v layers (see the module docstring), so that vLLM serves it as PEFT computes it.

    Everything else is copied byte for byte: every tensor, ``adapter_config.json`` and side files (README,
    tokenizer). The adapter is first read as `import_peft` reads it, with the same checks.

    Args:
      adapter_dir: a PEFT adapter directory.
      out_dir: the directory to create; must not exist or be empty.
      base_dir: the HF checkpoint the adapter was trained on; gives the architecture.
      spec: the architecture, when no ``base_dir`` is at hand.

    Returns:
      ``out_dir`` and the HF modules (e.g. ``model.layers.5.self_attn.v_proj``) whose copies were added: none
      for an adapter without k_proj on k_eq_v layers (Gemma 2/3, or Gemma 4 without that target) or one that
      has them already.
    """
    directory = Path(adapter_dir)
    out = check_output(out_dir, directory, base_dir)
    spec = resolve_spec(base_dir, spec)
    import_peft(directory, spec=spec)
    weights = SafetensorsFile(directory / ADAPTER_WEIGHTS)
    prefix = _text_prefix(weights)
    copies = _servable_copies(LoraLayout(spec, LoraSpec.from_peft(directory / ADAPTER_CONFIG)), stacklevel=3)
    sources = [TensorSource.copy_of(key, info) for key, info in weights.tensors.items()]
    added = []
    for k, v in copies.items():
        if f"{prefix}{v}.lora_A.weight" not in weights.tensors:
            sources += [TensorSource.copy_of(f"{prefix}{v}.lora_{x}.weight",
                                             weights.tensors[f"{prefix}{k}.lora_{x}.weight"]) for x in "AB"]
            added.append(prefix.removeprefix(PEFT_PREFIX) + v)
    with atomic_dir(out) as tmp:
        write_file(tmp / ADAPTER_WEIGHTS, sources, weights.metadata)
        for p in directory.iterdir():
            if p.is_file() and p.name != ADAPTER_WEIGHTS:
                shutil.copy2(p, tmp / p.name)
    return out, added


def _text_prefix(weights: SafetensorsFile) -> str:
    for prefix in names.TEXT_PREFIXES:
        if any(k.startswith(PEFT_PREFIX + prefix + "layers.") for k in weights.tensors):
            return PEFT_PREFIX + prefix
    raise LoraError(
        f"{weights.path}: no key starts with {PEFT_PREFIX}<text prefix>layers. (text prefixes "
        f"{list(names.TEXT_PREFIXES)}); is this a PEFT adapter of a Gemma model?"
    )


def _tensor(weights: SafetensorsFile, key: str) -> np.ndarray:
    array = weights.array(key)
    check_finite(key, array, source=str(weights.path), error=LoraError, fix="the adapter is broken")
    return array
