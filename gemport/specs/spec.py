"""`GemmaSpec`: one frozen description of a Gemma text architecture.

A spec is read from an HF ``config.json`` (``GemmaSpec.from_hf``) or named (``GemmaSpec.preset``), and it
drives everything else: the HF <-> Tunix name map, mesh checks, memory plans and the Tunix ``ModelConfig``.
Features gemport cannot reproduce exactly in Tunix raise ``SpecError`` instead of building a wrong model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

from gemport.errors import SpecError

SLIDING = "sliding"
GLOBAL = "global"


def layer_cycle(num_layers: int, period: int) -> tuple[str, ...]:
    """Layer types of a ``period - 1`` sliding : 1 global pattern (every ``period``-th layer global)."""
    return tuple(SLIDING if (i + 1) % period else GLOBAL for i in range(num_layers))


@dataclasses.dataclass(frozen=True)
class GemmaSpec:
    """A Gemma text architecture.

    Attributes:
      family: ``"gemma3"`` or ``"gemma4"``.
      num_layers, hidden, mlp, vocab: depth, model width D, MLP width F, vocabulary size V.
      num_heads: query heads N (every layer).
      head_dim, num_kv_heads: head width H and KV heads K on sliding layers.
      global_head_dim, global_kv_heads: H and K on global (full-attention) layers.
      k_eq_v: global layers project K only and use it as V (Gemma 4 31B, 26B-A4B).
      sliding_window: tokens a sliding layer sees, itself included.
      layer_types: ``"sliding"`` or ``"global"`` per layer.
      per_layer_input_dim: width P of Gemma 4's per-layer input embeddings (0 = none).
      num_kv_shared_layers: trailing layers that reuse earlier layers' K/V (no K/V weights of their own).
      double_wide_mlp: KV-shared layers have an MLP of width 2F.
      num_experts, experts_per_token, expert_dim: the MoE block (0 = dense).
      tied_embeddings: the LM head is the input embedding (always so in Tunix).
      final_logit_softcap: tanh cap on logits, or None.
      norm: ``"scale"`` (x * w, Gemma 4) or ``"one_plus_scale"`` (x * (1 + w), Gemma 2/3).
      local_rope_base, global_rope_base: RoPE base frequencies.
      global_rope_scale: linear RoPE scaling factor of global layers (Gemma 3 4B+: 8).
      global_rope_fraction: fraction of a global head that is rotated (Gemma 4: 0.25).
      query_scale: queries are multiplied by this before attention (Gemma 3: 1/sqrt(query_pre_attn_scalar)).

    Built from a checkpoint's ``config.json`` (``GemmaSpec.from_hf(dir)``) or a preset's published config
    (``GemmaSpec.preset(name)``, ``PRESETS``).

    Example:

      >>> from gemport import GemmaSpec
      >>> spec = GemmaSpec.preset("gemma4-31b")
      >>> spec.num_layers, spec.hidden, spec.layer_types[:6], spec.k_eq_v
      (60, 5376, ('sliding', 'sliding', 'sliding', 'sliding', 'sliding', 'global'), True)
    """

    family: Literal["gemma3", "gemma4"]
    num_layers: int
    hidden: int
    mlp: int
    vocab: int
    num_heads: int
    head_dim: int
    num_kv_heads: int
    global_head_dim: int
    global_kv_heads: int
    sliding_window: int
    layer_types: tuple[str, ...]
    k_eq_v: bool = False
    per_layer_input_dim: int = 0
    num_kv_shared_layers: int = 0
    double_wide_mlp: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    expert_dim: int = 0
    tied_embeddings: bool = True
    final_logit_softcap: float | None = None
    norm: Literal["scale", "one_plus_scale"] = "scale"
    local_rope_base: float = 10_000.0
    global_rope_base: float = 1_000_000.0
    global_rope_scale: float = 1.0
    global_rope_fraction: float = 1.0
    query_scale: float = 1.0

    def __post_init__(self):
        if len(self.layer_types) != self.num_layers:
            raise SpecError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers; give one per layer"
            )
        for i, kind in enumerate(self.layer_types):
            if kind not in (SLIDING, GLOBAL):
                raise SpecError(f"layer {i} has type {kind!r}; expected 'sliding' or 'global'")

    # Per-layer geometry -------------------------------------------------------------------------------

    def is_global(self, layer: int) -> bool:
        return self.layer_types[layer] == GLOBAL

    def layer_head_dim(self, layer: int) -> int:
        """H of ``layer``: ``global_head_dim`` on global layers, ``head_dim`` on sliding ones."""
        return self.global_head_dim if self.is_global(layer) else self.head_dim

    def layer_kv_heads(self, layer: int) -> int:
        """K of ``layer``."""
        return self.global_kv_heads if self.is_global(layer) else self.num_kv_heads

    def layer_k_eq_v(self, layer: int) -> bool:
        """Whether ``layer`` has a K projection only (Tunix ``k_einsum``), reused as V."""
        return self.k_eq_v and self.is_global(layer)

    def layer_kv_shared(self, layer: int) -> bool:
        """Whether ``layer`` reuses an earlier layer's K/V and has no K/V weights in HF checkpoints."""
        return layer >= self.num_layers - self.num_kv_shared_layers

    def layer_mlp(self, layer: int) -> int:
        """F of ``layer``'s dense MLP."""
        return self.mlp * 2 if self.double_wide_mlp and self.layer_kv_shared(layer) else self.mlp

    def layers_of(self, kind: str) -> tuple[int, ...]:
        """Indices of the ``"sliding"`` or ``"global"`` layers."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == kind)

    @property
    def fused_qkv(self) -> bool:
        """Tunix Gemma 3 fuses Q, K and V into one ``qkv_einsum`` when there are as many KV heads as query heads."""
        return self.family == "gemma3" and self.num_heads == self.num_kv_heads

    # Constructors ---------------------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, config: str | Path | dict[str, Any]) -> GemmaSpec:
        """Read a spec from an HF checkpoint directory, a ``config.json`` path, or its parsed dict.

        Accepts Gemma 3 (``gemma3_text``, and ``gemma3`` multimodal: its ``text_config``) and Gemma 4
        (``gemma4_text``, and ``gemma4`` multimodal: its ``text_config``). Raises ``SpecError`` for other
        model types and for features Tunix cannot reproduce (attention bias, bidirectional attention,
        attention softcaps, unsupported RoPE scaling, untied embeddings).
        """
        from gemport.specs.hf import spec_from_hf  # cycle: specs.hf builds GemmaSpecs

        return spec_from_hf(config)

    @classmethod
    def preset(cls, name: str) -> GemmaSpec:
        """The spec of a published size: one of ``GemmaSpec.presets()``."""
        from gemport.specs.presets import PRESETS  # cycle: the presets are GemmaSpecs

        try:
            return PRESETS[name]
        except KeyError:
            raise SpecError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}") from None

    @staticmethod
    def presets() -> tuple[str, ...]:
        """Names accepted by ``GemmaSpec.preset``."""
        from gemport.specs.presets import PRESETS  # cycle: the presets are GemmaSpecs

        return tuple(sorted(PRESETS))

    # Conversions ----------------------------------------------------------------------------------------

    def to_tunix(self, *, param_dtype=None, compute_dtype=None, sharding=None):
        """The Tunix ``ModelConfig`` of this architecture (``tunix.models.gemma3`` or ``gemma4``).

        Args:
          param_dtype: dtype of the parameters (default float32).
          compute_dtype: compute dtype (Gemma 4 only; Gemma 3 computes in ``param_dtype``).
          sharding: a Tunix ``ShardingConfig``; default is Tunix's default (axes ``fsdp`` and ``tp``).
        """
        from gemport.specs.tunix import tunix_config  # cycle, and JAX on first use

        return tunix_config(self, param_dtype=param_dtype, compute_dtype=compute_dtype, sharding=sharding)

    def tunix_model_class(self):
        """The Tunix model class: ``Gemma3`` or ``Gemma4``; with experts, a ``Gemma4`` whose MoE layers route
        tokens as transformers does (``gemport._src.moe``; Tunix 0.1.7's own routing differs)."""
        from gemport._src.extras import require  # cheap: `import gemport.specs` loads no JAX

        module = require(f"tunix.models.{self.family}.model", "building a Tunix model")
        if self.num_experts:
            from gemport._src.moe import model_class  # Tunix, an extra

            return model_class()
        return module.Gemma3 if self.family == "gemma3" else module.Gemma4

    def to_hf_config(self) -> dict[str, Any]:
        """A ``config.json`` dict for ``Gemma3ForCausalLM`` / ``Gemma4ForCausalLM`` with this architecture."""
        from gemport.specs.hf import hf_config  # cycle: specs.hf builds GemmaSpecs

        return hf_config(self)
