"""Qwix LoRA <-> PEFT adapter directories (``adapter_config.json`` + ``adapter_model.safetensors``).

PEFT keys are ``base_model.model.<text prefix><module>.lora_A.weight`` [r, in] and ``.lora_B.weight``
[out, r], e.g. ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import numpy as np

from gemport import names
from gemport.checkpoint.adapters import read_lora
from gemport.checkpoint.hf_dir import HFCheckpoint, base_spec
from gemport.checkpoint.load import matched_entries
from gemport.checkpoint.output import atomic_dir, check_output
from gemport.checkpoint.safetensors import SafetensorsFile, TensorSource, write_file
from gemport.errors import CheckpointError, LoraError, MissingTensorError, ShapeMismatchError, UnexpectedTensorError
from gemport.lora import VLLM_RANKS, LoraLayout, LoraParams, LoraSpec
from gemport.params import flat_params, lora_state
from gemport.specs import GemmaSpec

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def export_peft(lora, out_dir: str | Path, *, base_dir: str | Path | None = None, spec: GemmaSpec | None = None,
                lora_spec: LoraSpec | None = None, step: int | None = None,
                base_model_name_or_path: str | None = None) -> Path:
    """Write Qwix LoRA params as a PEFT adapter that ``peft.PeftModel.from_pretrained`` loads onto the HF base.

    Exact: separate factors of a fused module are split into each projection's ``lora_A`` / ``lora_B``
    (trimmed to its rank); a shared ``lora_a`` is written as the ``lora_A`` of each projection it fuses
    (kv_einsum -> k_proj and v_proj; k_eq_v layers' k_einsum -> k_proj only, no v_proj invented). The spec's
    ``rank_pattern`` / ``alpha_pattern`` go into ``adapter_config.json``. Warns when vLLM would refuse the
    adapter (rank outside ``VLLM_RANKS``: it needs a larger ``--max-lora-rank``, or above 512 cannot be
    served). Tensors keep the adapter's dtype.

    Args:
      lora: the LoRA factors, anything `read_lora` reads: `LoraParams`, an nnx model or state, a flat dict, or
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
    """
    out = check_output(out_dir, base_dir, lora if isinstance(lora, (str, os.PathLike)) else None)
    spec = base_spec(base_dir, spec)
    text_prefix = "model." if base_dir is None else matched_entries(HFCheckpoint(base_dir), spec)[0]
    if base_model_name_or_path is None and base_dir is not None:
        base_model_name_or_path = str(Path(base_dir).resolve())
    params, lora_spec = read_lora(lora, lora_spec=lora_spec, step=step)
    params = flat_params(params)
    sources, ranks = [], []
    for adapter, a, b in LoraLayout(spec, lora_spec).match(params):
        for module, (A, B) in zip(adapter.hf_modules, adapter.to_peft(a, b)):
            key = PEFT_PREFIX + text_prefix + module
            sources.append(_source(key + ".lora_A.weight", A))
            sources.append(_source(key + ".lora_B.weight", B))
            ranks.append(A.shape[0])
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

    Raises:
      LoraError: a config Qwix cannot reproduce, or NaN/Inf weights.
      MissingTensorError: an adapter tensor the targets need is absent.
      UnexpectedTensorError: an adapter tensor outside the text model's targets (e.g. a vision tower's).
      ShapeMismatchError: an adapter tensor's shape does not fit the base; names the tensor.
    """
    directory = Path(adapter_dir)
    spec = base_spec(base_dir, spec)
    for file in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (directory / file).is_file():
            raise CheckpointError(f"{directory}: no {file}; pass a PEFT adapter directory saved by save_pretrained")
    lora_spec = LoraSpec.from_peft(directory / ADAPTER_CONFIG)
    weights = SafetensorsFile(directory / ADAPTER_WEIGHTS)
    prefix = _text_prefix(weights)
    layout = LoraLayout(spec, lora_spec)

    flat, used = {}, set()
    for adapter in layout:
        out_size, in_size = adapter.entry.hf_shape
        pairs = []
        for module, rank in zip(adapter.hf_modules, adapter.ranks):
            keys = [f"{prefix}{module}.lora_{x}.weight" for x in "AB"]
            A, B = (_tensor(weights, key) for key in keys)
            used.update(keys)
            r = A.shape[0]
            if A.shape != (r, in_size) or B.shape != (out_size, r):
                raise ShapeMismatchError(
                    f"{weights.path}: {prefix}{module} has lora_A {list(A.shape)} and lora_B {list(B.shape)}, but "
                    f"the model needs [r, {in_size}] and [{out_size}, r]; the adapter is for a different model"
                )
            if r != rank:
                raise ShapeMismatchError(
                    f"{weights.path}: {prefix}{module} has rank {r}, but adapter_config.json says {rank}"
                )
            pairs.append((A, B))
        for name, value in zip((adapter.lora_a, adapter.lora_b), adapter.from_peft(pairs)):
            flat[name] = value
    extra = sorted(set(weights.tensors) - used)
    if extra:
        raise UnexpectedTensorError(
            f"{weights.path}: {extra[0]!r} (and {len(extra) - 1} more) has no place in this {spec.family} text "
            f"model with targets {list(lora_spec.targets)}; Tunix cannot carry adapters on other modules "
            "(vision/audio towers) or another model's layers"
        )
    return LoraParams(lora_state(flat), lora_spec)


def _text_prefix(weights: SafetensorsFile) -> str:
    for prefix in names.TEXT_PREFIXES:
        if any(k.startswith(PEFT_PREFIX + prefix + "layers.") for k in weights.tensors):
            return PEFT_PREFIX + prefix
    raise LoraError(
        f"{weights.path}: no key starts with {PEFT_PREFIX}<text prefix>layers. (text prefixes "
        f"{list(names.TEXT_PREFIXES)}); is this a PEFT adapter of a Gemma model?"
    )


def _tensor(weights: SafetensorsFile, key: str) -> np.ndarray:
    if key not in weights.tensors:
        raise MissingTensorError(f"{weights.path}: no {key!r}; the adapter_config targets it but the weights lack it")
    array = weights.array(key)
    if not np.isfinite(array.astype(np.float32)).all():
        raise LoraError(f"{weights.path}: {key!r} holds NaN or Inf; the adapter is broken")
    return np.asarray(array)
