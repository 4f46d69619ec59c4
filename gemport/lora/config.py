"""`LoraSpec`: a LoRA configuration as PEFT states it, which gemport carries onto Qwix and Tunix.

A spec is what a PEFT ``LoraConfig`` says (rank, alpha, targets, rsLoRA, dropout, per-module ``rank_pattern`` /
``alpha_pattern``, initialisation) plus how Tunix's fused modules carry it (``fused``). Where each target lands
on a model, and the shapes, shardings and Qwix rules that follow, is `gemport.lora.LoraLayout`'s business.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from os import PathLike
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np

from gemport.specs import names
from gemport.errors import LoraError
from gemport._src.jsonfile import Fields, read_json

# HF linear modules of a Gemma text layer that gemport maps to Qwix, in PEFT's spelling.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Gemma 4 MoE parameters PEFT's ``target_parameters`` can adapt and gemport carries (`gemport.lora.experts`): the
# experts' stacks, in the order transformers registers them on ``Gemma4TextExperts``, and the router's projection.
EXPERT_PARAMETERS = ("experts.gate_up_proj", "experts.down_proj", "router.proj.weight")

# The dtype of LoRA factors on any base, hence of their gradients and Adam's moments: PEFT keeps adapters in
# float32 on a half-precision base (``autocast_adapter_dtype``); in the base's bfloat16, late updates below its
# resolution (0.4% of a factor) would be lost.
FACTOR_DTYPE = "float32"

# Ranks vLLM accepts for max_lora_rank.
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """A LoRA configuration that PEFT and Qwix both understand.

    Attributes:
      rank: r.
      alpha: PEFT's ``lora_alpha`` (default PEFT's, 8). The delta is ``B @ A * scale`` with ``scale = alpha / rank``, or
        ``alpha / sqrt(rank)`` with rsLoRA.
      targets: PEFT target module names, a subset of ``PROJECTIONS`` (may be empty with ``parameters``).
      parameters: PEFT's ``target_parameters`` on a Gemma 4 MoE, a subset of ``EXPERT_PARAMETERS``: one
        rank-r LoRA per expert on the stacked expert weights, one on the router's projection
        (`gemport.lora.experts`). PEFT refuses
        ``lora_dropout`` with them, and so does this spec.
      rslora: PEFT's ``use_rslora``.
      dropout: PEFT's ``lora_dropout``: in training steps only (`gemport.lora.qwix.lora_dropout`), on each
        adapted projection's input to the LoRA branch, as PEFT in train mode; never in evaluation.
      fused: how a Tunix module fusing several targets (``kv_einsum`` = k_proj + v_proj, ``qkv_einsum``)
        holds them: ``"separate"`` (default), one A and one B per projection as PEFT trains them (``lora_a``
        (s, D, r), ``lora_b`` (s, r, K, H)); ``"shared"``, Qwix's own form with one A, for checkpoints trained
        with plain Qwix. See docs/lora.md#fused-modules-separate-factors.
      init: how a fresh adapter starts; B is always zero. ``"peft"`` (PEFT's default): A uniform in
        +-1/sqrt(fan_in), fan_in the HF projection's input width; ``"gaussian"``: A normal with std 1/r.
      all_linear: the targets came from PEFT's ``"all-linear"``; `LoraLayout` refuses a model where that
        includes modules Tunix LoRA cannot carry (docs/lora.md#pitfalls-gemport-refuses-or-prevents).
      rank_pattern, alpha_pattern: PEFT's per-module ranks and alphas, ``((key, value), ...)`` (a dict is
        accepted), matched against HF module names as PEFT matches them: the first key ``k`` for which
        ``(.*\\.)?(k)$`` matches the name.
    """

    rank: int
    alpha: float = 8.0
    targets: tuple[str, ...] = PROJECTIONS
    parameters: tuple[str, ...] = ()
    rslora: bool = False
    dropout: float = 0.0
    fused: Literal["separate", "shared"] = "separate"
    init: Literal["peft", "gaussian"] = "peft"
    rank_pattern: tuple[tuple[str, int], ...] = ()
    alpha_pattern: tuple[tuple[str, float], ...] = ()
    all_linear: bool = False

    def __post_init__(self):
        if not isinstance(self.rank, int) or self.rank < 1:
            raise LoraError(f"rank {self.rank!r}: a LoRA rank is a positive integer")
        unknown = sorted(set(self.targets) - set(PROJECTIONS))
        if unknown or not (self.targets or self.parameters):
            raise LoraError(
                f"targets {list(self.targets)}: gemport maps the projections {list(PROJECTIONS)} of Gemma text "
                f"layers{f'; not {unknown}' if unknown else ''}"
            )
        named = {_expert_parameter(p) for p in self.parameters}
        object.__setattr__(self, "parameters", tuple(p for p in EXPERT_PARAMETERS if p in named))
        if self.parameters and self.dropout:
            raise LoraError(
                f"lora_dropout={self.dropout} with target_parameters {list(self.parameters)}: PEFT's ParamWrapper "
                "refuses dropout on adapted parameters (it cannot be factored out of the merged weight); set "
                "lora_dropout to 0, as the GPU recipe must"
            )
        if self.fused not in ("separate", "shared"):
            raise LoraError(f"fused={self.fused!r}: expected 'separate' or 'shared'")
        if self.init not in ("peft", "gaussian"):
            raise LoraError(f"init={self.init!r}: expected 'peft' or 'gaussian'")
        object.__setattr__(self, "targets", tuple(p for p in PROJECTIONS if p in self.targets))
        for field, kind in (("rank_pattern", int), ("alpha_pattern", float)):
            pairs = tuple(dict(getattr(self, field)).items())
            for key, value in pairs:
                if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                    raise LoraError(f"{field}[{key!r}] = {value!r}: a LoRA rank is a positive integer")
                if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value)):
                    raise LoraError(f"{field}[{key!r}] = {value!r}: lora_alpha is a finite number")
                try:
                    re.compile(key)
                except (re.error, TypeError):
                    raise LoraError(f"{field} key {key!r} is not a regex PEFT can match") from None
            object.__setattr__(self, field, tuple((k, kind(v)) for k, v in pairs))

    @property
    def scale(self) -> float:
        """The factor on ``B @ A``: ``alpha / rank``, or ``alpha / sqrt(rank)`` with rsLoRA."""
        return self.scale_at(self.rank, self.alpha)

    def scale_at(self, rank: int, alpha: float) -> float:
        """PEFT's scale of a rank-``rank`` adapter with ``lora_alpha`` ``alpha``."""
        return alpha / (math.sqrt(rank) if self.rslora else rank)

    def rank_of(self, module: str) -> int:
        """PEFT's rank for HF module ``module`` (e.g. ``layers.0.self_attn.k_proj``): ``rank_pattern`` or r."""
        return _lookup(self.rank_pattern, module, self.rank)

    def alpha_of(self, module: str) -> float:
        """PEFT's ``lora_alpha`` for HF module ``module``: ``alpha_pattern`` or alpha."""
        return _lookup(self.alpha_pattern, module, self.alpha)

    def scale_of(self, module: str) -> float:
        """PEFT's scale for HF module ``module``."""
        return self.scale_at(self.rank_of(module), self.alpha_of(module))

    # PEFT -------------------------------------------------------------------------------------------------

    @classmethod
    def from_peft(cls, config: Any) -> LoraSpec:
        """Read a PEFT LoRA config: a ``peft.LoraConfig``, its dict, or an adapter directory / its json.

        ``init_lora_weights`` ``True`` / ``"gaussian"`` become ``init="peft"`` / ``"gaussian"``;
        ``rank_pattern`` / ``alpha_pattern`` are kept; ``target_parameters`` on the MoE experts become
        ``parameters``. Raises ``LoraError`` for what gemport cannot reproduce: DoRA, bias training,
        ``modules_to_save``, ``target_parameters`` other than the experts' (or with dropout), layer subsets, other
        initialisations (PiSSA, OLoRA, LoftQ...: import the initialised adapter with
        `gemport.checkpoint.import_peft` instead), or a regex ``target_modules``.
        """
        cfg = _peft_dict(config)
        if str(getattr(cfg.get("peft_type"), "value", cfg.get("peft_type"))) != "LORA":
            raise LoraError(f"peft_type {cfg.get('peft_type')!r}: only LoRA adapters map to Qwix")
        refused = {
            "use_dora": "DoRA has no Qwix equivalent; train a plain LoRA",
            "modules_to_save": "Qwix LoRA trains adapters only (and vLLM refuses such adapters); drop them",
            "layers_to_transform": "Qwix targets are per module kind; adapt every layer",
        }
        for key, why in refused.items():
            if cfg.get(key):
                raise LoraError(f"PEFT config sets {key}={cfg[key]!r}: {why}")
        if cfg.get("bias", "none") != "none":
            raise LoraError(f"PEFT config sets bias={cfg['bias']!r}: Gemma projections have no bias; use 'none'")
        targets = cfg.get("target_modules")
        parameters = cfg.get("target_parameters") or ()
        if isinstance(parameters, str):
            parameters = (parameters,)
        all_linear = targets == "all-linear"
        if all_linear:
            targets = PROJECTIONS
        elif parameters and targets in (None, []):
            targets = ()
        elif isinstance(targets, str) or not targets:
            raise LoraError(
                f"target_modules {targets!r}: give a list of module names from {list(PROJECTIONS)} "
                "(a regex cannot be mapped to Tunix modules reliably)"
            )
        init = cfg.get("init_lora_weights", True)
        if init not in (True, "gaussian"):
            raise LoraError(
                f"PEFT config sets init_lora_weights={init!r}: gemport starts fresh adapters as PEFT's default "
                "(True) or 'gaussian'; for other initialisations save the initialised PEFT adapter and import it "
                "with gemport.checkpoint.import_peft"
            )
        return cls(
            rank=int(cfg["r"]),
            alpha=float(cfg["lora_alpha"]),
            targets=tuple(targets),
            parameters=tuple(parameters),
            rslora=bool(cfg.get("use_rslora", False)),
            dropout=float(cfg.get("lora_dropout") or 0.0),
            init="peft" if init is True else "gaussian",
            rank_pattern=cfg.get("rank_pattern") or (),
            alpha_pattern=cfg.get("alpha_pattern") or (),
            all_linear=all_linear,
        )

    def to_peft(self, base_model_name_or_path: str | None = None) -> dict[str, Any]:
        """The ``adapter_config.json`` dict of this spec (``peft.LoraConfig(**d)`` accepts it too)."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model_name_or_path,
            "r": self.rank,
            "lora_alpha": self.alpha,
            "target_modules": "all-linear" if self.all_linear else list(self.targets),
            **({"target_parameters": list(self.parameters)} if self.parameters else {}),
            "lora_dropout": self.dropout,
            "bias": "none",
            "use_rslora": self.rslora,
            "use_dora": False,
            "fan_in_fan_out": False,
            "modules_to_save": None,
            "rank_pattern": dict(self.rank_pattern),
            "alpha_pattern": dict(self.alpha_pattern),
            "init_lora_weights": "gaussian" if self.init == "gaussian" else True,
            "inference_mode": True,
        }

    # Storage ----------------------------------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> LoraSpec:
        fields = json.loads(text)
        return cls(**dict(fields, targets=tuple(fields["targets"]), parameters=tuple(fields.get("parameters", ())),
                          rank_pattern=tuple(map(tuple, fields.get("rank_pattern", ()))),
                          alpha_pattern=tuple(map(tuple, fields.get("alpha_pattern", ())))))


class LoraParams(NamedTuple):
    """LoRA factors with the `LoraSpec` that shapes them: what `gemport.checkpoint.import_peft` and
    `gemport.checkpoint.load_lora` return, and what `apply_lora` and the exports take.

    Attributes:
      params: the factors, an ``nnx.State`` of ``nnx.LoRAParam`` with the Tunix model's paths (or a nested dict
        of arrays laid out the same way), e.g. kv_einsum's separate ``w_lora_a`` [2, D, r] and ``w_lora_b``
        [2, r, K, H]; each factor's shape is `LoraLayout.shapes`' for ``lora_spec``.
      lora_spec: the rank, alpha, targets and fused form the factors were made for.
    """

    params: Any
    lora_spec: LoraSpec

    def flat(self) -> dict[str, Any]:
        """The factors as ``{dotted path: numpy array}``, e.g. for ``np.savez`` or a comparison."""
        from gemport._src.params import flat_params  # cycle: _src.params builds models from specs

        return {k: np.asarray(v) for k, v in flat_params(self.params).items()}


# PEFT options that change what an adapter computes or how it trains; Qwix LoRA has none of them.
_PEFT_VARIANTS = {
    "alora_invocation_tokens": "aLoRA turns the adapter on only after its invocation tokens; Qwix LoRA is always on",
    "exclude_modules": "gemport adapts every layer's target_modules; list the targets without exclusions",
    "trainable_token_indices": "it trains rows of the embedding, which Qwix LoRA does not",
    "lora_bias": "it trains a bias beside lora_B, which Qwix LoRA has not",
    "layer_replication": "it repeats layers, which the Tunix model does not",
    "use_qalora": "QALoRA pools the adapter's input by quantization group; Qwix LoRA does not",
    "use_bdlora": "block-diagonal factors have no Qwix equivalent",
    "arrow_config": "Arrow routes between several adapters; Qwix LoRA is one adapter",
    "kasa_config": "KaSA rewrites the base weight's singular values",
    "monteclora_config": "Monte Carlo sampling of the adapter has no Qwix equivalent",
    "velora_config": "VeLoRA replaces the adapter's backward pass",
}


def _peft_dict(config: Any) -> dict[str, Any]:
    """The fields of a PEFT LoRA config, checked: ``r`` a positive integer, ``lora_alpha`` a number, no option
    that changes the adapter's function (`_PEFT_VARIANTS`). A config without ``peft_type`` is LoRA, as
    ``LoraConfig(**d)`` reads it. Raises ``LoraError`` naming the file (or ``PEFT config``) and the field."""
    if isinstance(config, Mapping) or hasattr(config, "to_dict"):
        cfg, source = dict(config) if isinstance(config, Mapping) else config.to_dict(), "PEFT config"
    elif isinstance(config, (str, PathLike)):
        path = Path(config)
        cfg = read_json(path, "adapter_config.json", LoraError, "a PEFT adapter directory, config or dict")
        source = str(path / "adapter_config.json" if path.is_dir() else path)
    else:
        raise LoraError(f"{config!r:.80}: pass a peft.LoraConfig, its dict, or a PEFT adapter directory")
    fields = Fields(cfg, source, LoraError)
    if cfg.get("peft_type") is None:
        cfg["peft_type"] = "LORA"
    for key, why in _PEFT_VARIANTS.items():
        if cfg.get(key):
            raise LoraError(f"{source} sets {key}={cfg[key]!r:.80}: {why}")
    cfg["r"] = fields.integer("r")
    cfg["lora_alpha"] = fields.number("lora_alpha")
    fields.number("lora_dropout", None, minimum=0.0, below=1.0)
    fields.boolean("use_rslora", None)
    ranks, alphas = fields.fields("rank_pattern"), fields.fields("alpha_pattern")
    for key in ranks.data:
        ranks.integer(key)
    for key in alphas.data:
        alphas.number(key)
    return cfg


def _expert_parameter(target: str) -> str:
    """PEFT's ``target_parameters`` entry as one of ``EXPERT_PARAMETERS``. PEFT matches an entry against
    ``<module>.<parameter>`` names by equality or dotted suffix: ``gate_up_proj``, ``experts.gate_up_proj`` and
    ``model.layers.experts.gate_up_proj``-like suffixes that name every layer map, and ``router.proj.weight``;
    a layer subset or any other parameter is refused by name."""
    for parameter in EXPERT_PARAMETERS:
        full = f"model.language_model.layers.0.{parameter}"
        # A router entry must name router.proj: a shorter suffix ("weight") reaches every linear layer in PEFT.
        named = target == full or full.endswith("." + target) if isinstance(target, str) else False
        if named and ".0." not in "." + target and (target.endswith("router.proj.weight") or "router" not in parameter):
            return parameter
    if isinstance(target, str) and re.search(r"\.\d+\.", "." + target):
        why = "it names a layer subset; gemport adapts the MoE of every layer"
    else:
        why = f"gemport carries target_parameters on the Gemma 4 MoE only: {list(EXPERT_PARAMETERS)}"
    raise LoraError(f"target_parameters entry {target!r}: {why}")


def _lookup(pattern: tuple[tuple[str, Any], ...], module: str, default):
    """PEFT's pattern lookup; ``module`` is relative to the text model, keys may name it with a text prefix."""
    for key, value in pattern:
        if any(re.match(rf"(.*\.)?({key})$", prefix + module) for prefix in ("", *names.TEXT_PREFIXES)):
            return value
    return default


def peft_default_targets(model_type: str) -> tuple[str, ...]:
    """PEFT's ``target_modules`` for a ``LoraConfig`` that leaves them unset, on a checkpoint of ``model_type``
    (its ``config.json``'s), as gemport target names.

    PEFT looks ``model_type`` up in ``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`` (PEFT 0.21:
    ``gemma3_text`` -> q_proj and v_proj; ``gemma4`` -> a regex over the language model's q_proj and v_proj;
    nothing for ``gemma3`` or ``gemma4_text``, where PEFT raises). A regex is read the way PEFT matches it
    (``re.fullmatch`` on module names) against the language model's projections. Raises ``LoraError`` naming
    ``lora_target_modules`` where PEFT has no default, or its regex also reaches modules gemport does not port.
    """
    from gemport._src.extras import require  # PEFT, an extra, on first use

    mapping = require("peft.utils.constants", "lora_target_modules' PEFT default")
    default = mapping.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type)
    if default is None:
        raise LoraError(f"lora_target_modules is unset and PEFT has no default for model_type {model_type!r} "
                        "(PEFT raises 'Please specify target_modules'); set lora_target_modules, e.g. "
                        "[q_proj, v_proj]")
    if not isinstance(default, str):
        return tuple(p for p in PROJECTIONS if p in default)
    prefix = "model.language_model.layers.0." if model_type in ("gemma3", "gemma4") else "model.layers.0."
    block = {p: "self_attn" if p in PROJECTIONS[:4] else "mlp" for p in PROJECTIONS}
    targets = tuple(p for p in PROJECTIONS if re.fullmatch(default, f"{prefix}{block[p]}.{p}"))
    other = "model.vision_tower.encoder.layers.0.self_attn.q_proj"
    if not targets or re.fullmatch(default, other):
        raise LoraError(f"lora_target_modules is unset and PEFT's default for model_type {model_type!r} "
                        f"({default!r}) does not map onto the language model's projections; set "
                        "lora_target_modules")
    return targets
