"""LoRA between PEFT and Qwix: one config (`LoraSpec`) and where each PEFT target lands in a Tunix model.

PEFT adapts HF linear modules (``q_proj``, ``k_proj``...), each with ``lora_A`` [r, in] and ``lora_B``
[out, r]. Qwix adapts Tunix modules, whose weights fuse and reshape those linears (``gemport.names``): one
``kv_einsum`` (2, K, D, H) holds ``k_proj`` and ``v_proj``. Qwix gives a Tunix weight ``lora_a`` made of the
weight's input axes then r, and ``lora_b`` made of r then the remaining axes, in the weight's order. Both
layouts follow from a names-table entry, so `Target` derives them from it instead of listing modules by hand:

| Tunix weight | HF -> Tunix | lora_a | lora_b |
|---|---|---|---|
| q_einsum | ``(n h) d -> n d h`` | ``d r`` | ``r n h`` |
| kv_einsum | ``s (k h) d -> s k d h`` | ``d r`` (shared by K and V) | ``r s k h`` |
| attn_vec_einsum | ``d (n h) -> n h d`` | ``n h r`` | ``r d`` |
| mlp.down_proj | ``d f -> f d`` | ``f r`` | ``r d`` |

A fused module's adapter is exact in PEFT as one adapter per projection sharing ``lora_A``. The other way,
rank-r PEFT adapters on k_proj and v_proj are exact in a kv_einsum only as one rank-2r adapter: A = [A_k | A_v]
and B block-diagonal. `LoraSpec.fused` says which of the two a Tunix model carries.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from os import PathLike
from pathlib import Path
from typing import Any, Literal

import einops
import numpy as np

from gemport import names
from gemport.errors import LoraError
from gemport.jsonfile import Fields, read_json
from gemport.specs import GemmaSpec

# HF linear modules of a Gemma text layer that gemport maps to Qwix, in PEFT's spelling.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Ranks vLLM accepts for max_lora_rank.
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclasses.dataclass(frozen=True)
class Target:
    """A Tunix module that carries LoRA, and the HF linear modules (PEFT targets) it stands for.

    Attributes:
      entry: the names-table entry of the module's weight.
      a, b: einops axes of Qwix's ``lora_a`` and ``lora_b``, e.g. ``"d r"`` and ``"r s k h"``.
      hf_in, hf_out: axes of an HF weight's input and output dimension, e.g. ``"d"`` and ``"k h"``.
    """

    entry: names.Entry
    a: str
    b: str
    hf_in: str
    hf_out: str

    @property
    def module(self) -> str:
        """Dotted Tunix module path, e.g. ``layers.0.attn.kv_einsum``."""
        return self.entry.module

    @property
    def qwix_path(self) -> str:
        """The module path as Qwix matches it: ``layers/0/attn/kv_einsum``."""
        return self.module.replace(".", "/")

    @property
    def lora_a(self) -> str:
        return self.entry.tunix + "_lora_a"

    @property
    def lora_b(self) -> str:
        return self.entry.tunix + "_lora_b"

    @property
    def hf_modules(self) -> tuple[str, ...]:
        """HF module paths relative to the text prefix, e.g. ``("layers.0.self_attn.k_proj", ...)``."""
        return tuple(h.removesuffix(".weight") for h in self.entry.hf)

    @property
    def fused(self) -> bool:
        return len(self.entry.hf) > 1

    def shapes(self, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of ``lora_a`` and ``lora_b`` at ``rank``."""
        sizes = dict(self.entry.sizes, r=rank)
        return tuple(sizes[x] for x in self.a.split()), tuple(sizes[x] for x in self.b.split())

    def to_peft(self, a: np.ndarray, b: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """Qwix ``lora_a``, ``lora_b`` -> PEFT (``lora_A`` [r, in], ``lora_B`` [out, r]) per HF module, exactly.

        A fused module's ``lora_a`` becomes every projection's ``lora_A``; ``lora_b`` is split along ``s``.
        """
        lora_A = self._rearrange(a, f"{self.a} -> r ({self.hf_in})")
        stack = "s " if self.fused else ""
        lora_B = self._rearrange(b, f"{self.b} -> {stack}({self.hf_out}) r")
        return [(lora_A, B) for B in lora_B] if self.fused else [(lora_A, lora_B)]

    def from_peft(self, pairs: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
        """PEFT (``lora_A`` [r_i, in], ``lora_B`` [out, r_i]) per HF module -> Qwix ``lora_a``, ``lora_b``.

        Several projections are stacked: A = [A_1 | A_2 ...] of rank sum(r_i), B block-diagonal, so that
        ``lora_b``'s slice ``s = i`` sees only ``A_i``. Exact, with the scale unchanged.
        """
        lora_A = np.concatenate([A for A, _ in pairs])
        lora_B = np.zeros((len(pairs), pairs[0][1].shape[0], lora_A.shape[0]), lora_A.dtype)
        start = 0
        for i, (A, B) in enumerate(pairs):
            lora_B[i, :, start : start + A.shape[0]] = B
            start += A.shape[0]
        stack = "s " if self.fused else ""
        a = self._rearrange(lora_A, f"r ({self.hf_in}) -> {self.a}")
        b = self._rearrange(lora_B if self.fused else lora_B[0], f"{stack}({self.hf_out}) r -> {self.b}")
        return a, b

    def _rearrange(self, x: np.ndarray, pattern: str) -> np.ndarray:
        used = set(re.findall(r"\w", pattern))
        return einops.rearrange(x, pattern, **{k: n for k, n in self.entry.sizes if k in used})


def _target(entry: names.Entry) -> Target:
    hf_side, tunix_side = entry.layout.split("->")
    groups = [tuple((group or name).split()) for group, name in re.findall(r"\(([^)]*)\)|(\w+)", hf_side)]
    out_axes, in_axes = groups[-2], groups[-1]  # an HF linear weight is [out, in], after the stacking axis s
    axes = tunix_side.split()
    return Target(
        entry=entry,
        a=" ".join([x for x in axes if x in in_axes] + ["r"]),
        b=" ".join(["r"] + [x for x in axes if x not in in_axes]),
        hf_in=" ".join(in_axes),
        hf_out=" ".join(out_axes),
    )


def _projection(hf_name: str) -> str | None:
    parts = hf_name.split(".")
    return parts[-2] if parts[-1] == "weight" and parts[-2] in PROJECTIONS else None


def targets(spec: GemmaSpec, peft_targets: Iterable[str]) -> tuple[Target, ...]:
    """The Tunix modules that PEFT ``target_modules`` (names from ``PROJECTIONS``) mean on ``spec``'s model.

    Derived from the names table: ``k_proj`` + ``v_proj`` are the ``kv_einsum`` of sliding layers and the
    ``k_einsum`` of k_eq_v global layers; KV-shared layers (no K/V weights) get nothing; vision and audio
    towers are never included. Raises ``LoraError`` when the targets name only some projections of a fused
    Tunix module (``k_proj`` without ``v_proj`` on a ``kv_einsum``), which Tunix cannot express.
    """
    wanted = set(peft_targets)
    out = []
    for entry in names.entries(spec):
        projections = [_projection(h) for h in entry.hf]
        if not entry.hf or None in projections:
            continue
        hit = [p for p in projections if p in wanted]
        if not hit:
            continue
        if len(hit) < len(projections):
            missing = [p for p in projections if p not in wanted]
            raise LoraError(
                f"target_modules has {hit} but not {missing}: Tunix fuses {' + '.join(projections)} into one "
                f"{entry.module}, which carries a single LoRA for all of them; add {missing} to target_modules "
                f"or remove {hit}"
            )
        out.append(_target(entry))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """A LoRA configuration that PEFT and Qwix both understand.

    Attributes:
      rank: r.
      alpha: PEFT's ``lora_alpha``. The delta is ``B @ A * scale`` with ``scale = alpha / rank``, or
        ``alpha / sqrt(rank)`` with rsLoRA.
      targets: PEFT target module names, a subset of ``PROJECTIONS``.
      rslora: PEFT's ``use_rslora``. Qwix always scales by ``alpha / rank``; `to_qwix` passes it the alpha
        that gives the same scale.
      dropout: PEFT's ``lora_dropout``. Qwix applies it on every call, evaluation included.
      fused: how a Tunix module fusing several targets (``kv_einsum``, ``qkv_einsum``) holds them:
        ``"shared"``, one rank-r adapter with a single A (what Qwix trains); ``"stacked"``, one rank-r
        adapter per projection stacked to rank m*r with block-diagonal B (what `import_peft` makes).
    """

    rank: int
    alpha: float
    targets: tuple[str, ...] = PROJECTIONS
    rslora: bool = False
    dropout: float = 0.0
    fused: Literal["shared", "stacked"] = "shared"

    def __post_init__(self):
        if not isinstance(self.rank, int) or self.rank < 1:
            raise LoraError(f"rank {self.rank!r}: a LoRA rank is a positive integer")
        unknown = sorted(set(self.targets) - set(PROJECTIONS))
        if unknown or not self.targets:
            raise LoraError(
                f"targets {list(self.targets)}: gemport maps the projections {list(PROJECTIONS)} of Gemma text "
                f"layers{f'; not {unknown}' if unknown else ''}"
            )
        if self.fused not in ("shared", "stacked"):
            raise LoraError(f"fused={self.fused!r}: expected 'shared' or 'stacked'")
        object.__setattr__(self, "targets", tuple(p for p in PROJECTIONS if p in self.targets))

    @property
    def scale(self) -> float:
        """The factor on ``B @ A``: ``alpha / rank``, or ``alpha / sqrt(rank)`` with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def alpha_at(self, rank: int) -> float:
        """The ``lora_alpha`` that gives a rank-``rank`` adapter this spec's scale."""
        return self.scale * (math.sqrt(rank) if self.rslora else rank)

    def module_rank(self, target: Target) -> int:
        """The Qwix rank of ``target``'s module: r, or m*r for a module stacking m projections."""
        return self.rank * (len(target.entry.hf) if self.fused == "stacked" else 1)

    # PEFT -------------------------------------------------------------------------------------------------

    @classmethod
    def from_peft(cls, config: Any) -> LoraSpec:
        """Read a PEFT LoRA config: a ``peft.LoraConfig``, its dict, or an adapter directory / its json.

        Raises ``LoraError`` for what Qwix LoRA cannot reproduce: DoRA, bias training, ``modules_to_save``,
        ``target_parameters``, layer subsets, per-module ``rank_pattern`` / ``alpha_pattern`` (use
        `gemport.checkpoint.import_peft`, which reads them from the adapter), or a regex ``target_modules``.
        """
        cfg = _peft_dict(config)
        if str(getattr(cfg.get("peft_type"), "value", cfg.get("peft_type"))) != "LORA":
            raise LoraError(f"peft_type {cfg.get('peft_type')!r}: only LoRA adapters map to Qwix")
        refused = {
            "use_dora": "DoRA has no Qwix equivalent; train a plain LoRA",
            "modules_to_save": "Qwix LoRA trains adapters only (and vLLM refuses such adapters); drop them",
            "target_parameters": "adapters on raw parameters (MoE experts) have no Qwix equivalent",
            "layers_to_transform": "Qwix targets are per module kind; adapt every layer",
            "rank_pattern": "use gemport.checkpoint.import_peft, which applies per-module ranks exactly",
            "alpha_pattern": "use gemport.checkpoint.import_peft, which applies per-module alphas exactly",
        }
        for key, why in refused.items():
            if cfg.get(key):
                raise LoraError(f"PEFT config sets {key}={cfg[key]!r}: {why}")
        if cfg.get("bias", "none") != "none":
            raise LoraError(f"PEFT config sets bias={cfg['bias']!r}: Gemma projections have no bias; use 'none'")
        targets = cfg.get("target_modules")
        if targets == "all-linear":
            targets = PROJECTIONS
        elif isinstance(targets, str) or not targets:
            raise LoraError(
                f"target_modules {targets!r}: give a list of module names from {list(PROJECTIONS)} "
                "(a regex cannot be mapped to Tunix modules reliably)"
            )
        return cls(
            rank=int(cfg["r"]),
            alpha=float(cfg["lora_alpha"]),
            targets=tuple(targets),
            rslora=bool(cfg.get("use_rslora", False)),
            dropout=float(cfg.get("lora_dropout") or 0.0),
        )

    def to_peft(self, base_model_name_or_path: str | None = None) -> dict[str, Any]:
        """The ``adapter_config.json`` dict of this spec (``peft.LoraConfig(**d)`` accepts it too)."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model_name_or_path,
            "r": self.rank,
            "lora_alpha": self.alpha,
            "target_modules": list(self.targets),
            "lora_dropout": self.dropout,
            "bias": "none",
            "use_rslora": self.rslora,
            "use_dora": False,
            "fan_in_fan_out": False,
            "modules_to_save": None,
            "rank_pattern": {},
            "alpha_pattern": {},
            "init_lora_weights": True,
            "inference_mode": True,
        }

    # Qwix -------------------------------------------------------------------------------------------------

    def to_qwix(self, spec: GemmaSpec):
        """A ``qwix.LoraProvider`` whose rules match exactly the Tunix modules of `targets` on ``spec``.

        Module paths are anchored (``layers/(?:0|1)/attn/q_einsum``), so they never reach a vision encoder.
        Modules of different Qwix rank (``fused="stacked"``) get one rule per rank; every rule's alpha is
        ``scale * rank``, Qwix's scaling being ``alpha / rank``.
        """
        import qwix

        by_rank: dict[int, list[str]] = defaultdict(list)
        for t in targets(spec, self.targets):
            by_rank[self.module_rank(t)].append(t.qwix_path)
        return qwix.LoraProvider([
            qwix.LoraRule(module_path=_alternation(paths), rank=rank, alpha=self.scale * rank, dropout=self.dropout)
            for rank, paths in sorted(by_rank.items())
        ])

    # Storage ----------------------------------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> LoraSpec:
        fields = json.loads(text)
        return cls(**dict(fields, targets=tuple(fields["targets"])))


def _alternation(paths: list[str]) -> str:
    """A regex matching exactly ``paths``, with layer indices grouped: ``layers/(?:0|5)/attn/q_einsum``."""
    layers: dict[str, list[str]] = defaultdict(list)
    for path in paths:
        _, layer, rest = path.split("/", 2)
        layers[rest].append(layer)
    return "|".join(f"layers/(?:{'|'.join(idx)})/{re.escape(rest)}" for rest, idx in layers.items())


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


def apply_lora(model, spec: GemmaSpec, lora_spec: LoraSpec, state=None, *, seed: int = 0):
    """Qwix LoRA on a Tunix Gemma model per ``lora_spec``; returns the new model (the input is not modified).

    Runs ``qwix.apply_lora_to_model`` on a dummy batch. With ``state`` (e.g. from
    `gemport.checkpoint.import_peft`), the LoRA params are then set to it.
    """
    import jax.numpy as jnp
    import qwix
    from flax import nnx

    tokens = jnp.zeros((1, 2), jnp.int32)
    positions = jnp.arange(2)[None]
    mask = jnp.tril(jnp.ones((1, 2, 2), bool))
    lora_model = qwix.apply_lora_to_model(model, lora_spec.to_qwix(spec), tokens, positions, None, mask,
                                          rngs=nnx.Rngs(seed))
    if state is not None:
        nnx.update(lora_model, state)
    return lora_model
