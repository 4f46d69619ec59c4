"""Qwix LoRA <-> PEFT adapter directories (``adapter_config.json`` + ``adapter_model.safetensors``).

PEFT keys are ``base_model.model.<text prefix><module>.lora_A.weight`` [r, in] and ``.lora_B.weight``
[out, r], e.g. ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import warnings
from pathlib import Path

import numpy as np
from flax import nnx

from gemport import names
from gemport.checkpoint.adapters import match, resolve
from gemport.checkpoint.output import atomic_dir, check_output
from gemport.checkpoint.safetensors import SafetensorsFile, TensorSource, write_file
from gemport.errors import CheckpointError, LoraError, MissingTensorError, ShapeMismatchError, UnexpectedTensorError
from gemport.lora import VLLM_RANKS, LoraSpec, targets
from gemport.specs import GemmaSpec

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def export_peft(lora, out_dir: str | Path, *, spec: GemmaSpec, lora_spec: LoraSpec | None = None,
                base_model_name_or_path: str | None = None, text_prefix: str = "model.",
                step: int | None = None) -> Path:
    """Write Qwix LoRA params as a PEFT adapter that ``peft.PeftModel.from_pretrained`` loads onto the HF base.

    Exact: a fused module's shared ``lora_a`` is written as the ``lora_A`` of each projection it fuses
    (kv_einsum -> k_proj and v_proj; k_eq_v layers' k_einsum -> k_proj only, no v_proj invented). HF modules
    whose rank differs from ``lora_spec.rank`` (stacked fused modules) get ``rank_pattern`` entries and an
    ``alpha_pattern`` that keeps their scale equal to every other module's. Warns when vLLM would refuse the
    adapter (rank outside ``VLLM_RANKS``: it needs a larger ``--max-lora-rank``, or above 512 cannot be
    served). Tensors keep the adapter's dtype.

    Args:
      lora: the Qwix LoRA params (nnx model or state, flat dict, or PeftTrainer Orbax checkpoint path).
      out_dir: the adapter directory to create; must not exist or be empty.
      spec: the architecture the adapter was trained on.
      lora_spec: rank, alpha, targets; default the one recorded beside an Orbax checkpoint.
      base_model_name_or_path: written into ``adapter_config.json`` for PEFT and vLLM to find the base.
      text_prefix: the HF text model's module path: ``"model."`` for ``Gemma*ForCausalLM``,
        ``"model.language_model."`` for ``Gemma*ForConditionalGeneration``.
      step: with an Orbax checkpoint root, the step to export; default the latest.
    """
    out = check_output(out_dir, lora if isinstance(lora, (str, os.PathLike)) else None)
    params, lora_spec = resolve(lora, lora_spec, step=step)
    sources, ranks = [], {}
    for target, a, b in match(params, spec, lora_spec):
        for module, (A, B) in zip(target.hf_modules, target.to_peft(a, b)):
            key = PEFT_PREFIX + text_prefix + module
            sources.append(_source(key + ".lora_A.weight", A))
            sources.append(_source(key + ".lora_B.weight", B))
            ranks[text_prefix + module] = A.shape[0]
    config = lora_spec.to_peft(base_model_name_or_path)
    odd = {module: r for module, r in ranks.items() if r != lora_spec.rank}
    config["rank_pattern"] = odd
    config["alpha_pattern"] = {module: lora_spec.alpha_at(r) for module, r in odd.items()}
    top = max(ranks.values())
    if top not in VLLM_RANKS:
        fits = [r for r in VLLM_RANKS if r > top]
        warnings.warn(
            f"adapter rank {top} is not one of vLLM's max_lora_rank values {VLLM_RANKS}: "
            + (f"serve it with --max-lora-rank {fits[0]} or more" if fits else "vLLM cannot serve it"),
            stacklevel=2,
        )
    with atomic_dir(out) as tmp:
        write_file(tmp / ADAPTER_WEIGHTS, sources)
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out


def _source(name: str, array: np.ndarray) -> TensorSource:
    return TensorSource.from_array(name, lambda: array, array.dtype, array.shape)


def import_peft(adapter_dir: str | Path, spec: GemmaSpec):
    """Read a PEFT LoRA adapter as Qwix LoRA params for the Tunix model of ``spec``, exactly.

    Adapters on projections that Tunix fuses are stacked (see `gemport.lora.Target.from_peft`): k_proj and
    v_proj of rank r become one kv_einsum adapter of rank 2r (q/k/v into qkv_einsum: 3r) with the same scale.
    Per-module ``rank_pattern`` / ``alpha_pattern`` are honoured: smaller ranks are zero-padded to the largest
    and each module's scale is folded into its ``lora_b``.

    Returns:
      ``(lora_spec, state)``: the spec, with ``fused="stacked"``, whose ``to_qwix(spec)`` creates params of
      exactly these shapes; and an ``nnx.State`` of ``nnx.LoRAParam`` (``layers.0.attn.kv_einsum.w_lora_a``
      ...) to ``nnx.update`` into the model after ``qwix.apply_lora_to_model``.

    Raises:
      LoraError: a config Qwix cannot reproduce, or NaN/Inf weights.
      MissingTensorError: an adapter tensor the targets need is absent.
      UnexpectedTensorError: an adapter tensor outside the text model's targets (e.g. a vision tower's).
      ShapeMismatchError: an adapter tensor's shape does not fit the base; names the tensor.
    """
    directory = Path(adapter_dir)
    for file in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (directory / file).is_file():
            raise CheckpointError(f"{directory}: no {file}; pass a PEFT adapter directory saved by save_pretrained")
    config = json.loads((directory / ADAPTER_CONFIG).read_text())
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    lora_spec = LoraSpec.from_peft(dict(config, rank_pattern={}, alpha_pattern={}))
    weights = SafetensorsFile(directory / ADAPTER_WEIGHTS)
    prefix = _text_prefix(weights)

    pairs, scales = {}, {}
    for target in targets(spec, lora_spec.targets):
        out_size, in_size = target.entry.hf_shape
        for module in target.hf_modules:
            A, B = (_tensor(weights, f"{prefix}{module}.lora_{x}.weight") for x in "AB")
            r = A.shape[0]
            if A.shape != (r, in_size) or B.shape != (out_size, r):
                raise ShapeMismatchError(
                    f"{weights.path}: {prefix}{module} has lora_A {list(A.shape)} and lora_B {list(B.shape)}, but "
                    f"the model needs [r, {in_size}] and [{out_size}, r]; the adapter is for a different model"
                )
            name = prefix.removeprefix(PEFT_PREFIX) + module
            rank = int(rank_pattern.get(_pattern_key(rank_pattern, name), lora_spec.rank))
            alpha = float(alpha_pattern.get(_pattern_key(alpha_pattern, name), lora_spec.alpha))
            if rank != r:
                raise ShapeMismatchError(f"{weights.path}: {name} has rank {r}, but adapter_config.json says {rank}")
            scales[module] = alpha / (math.sqrt(r) if lora_spec.rslora else r)
            pairs[module] = (A, B)
    used = {f"{prefix}{m}.lora_{x}.weight" for m in pairs for x in "AB"}
    extra = sorted(set(weights.tensors) - used)
    if extra:
        raise UnexpectedTensorError(
            f"{weights.path}: {extra[0]!r} (and {len(extra) - 1} more) has no place in this {spec.family} text "
            f"model with targets {list(lora_spec.targets)}; Tunix cannot carry adapters on other modules "
            "(vision/audio towers) or another model's layers"
        )

    rank = max(A.shape[0] for A, _ in pairs.values())
    stacked = dataclasses.replace(lora_spec, rank=rank, alpha=lora_spec.alpha_at(rank), fused="stacked")
    flat = []
    for target in targets(spec, lora_spec.targets):
        a, b = target.from_peft([
            _padded(*pairs[m], rank, scales[m] / stacked.scale) for m in target.hf_modules
        ])
        dtype = pairs[target.hf_modules[0]][0].dtype
        for name, value in ((target.lora_a, a), (target.lora_b, b)):
            path = tuple(int(p) if p.isdigit() else p for p in name.split("."))
            flat.append((path, nnx.LoRAParam(value.astype(dtype))))
    return stacked, nnx.from_flat_state(flat)


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


def _pattern_key(patterns: dict, name: str) -> str | None:
    """The ``rank_pattern`` / ``alpha_pattern`` key that applies to module ``name``, as PEFT matches them."""
    return next((key for key in patterns if re.match(rf"(.*\.)?({key})$", name)), None)


def _padded(A: np.ndarray, B: np.ndarray, rank: int, factor: float) -> tuple[np.ndarray, np.ndarray]:
    """Zero-pad an adapter to ``rank`` and fold ``factor`` (its scale over the common one) into B: exact."""
    A32 = np.zeros((rank, A.shape[1]), np.float32)
    A32[: A.shape[0]] = A
    B32 = np.zeros((B.shape[0], rank), np.float32)
    B32[:, : B.shape[1]] = B.astype(np.float32) * np.float32(factor)
    return A32, B32
