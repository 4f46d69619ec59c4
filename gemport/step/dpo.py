"""DPO's loss and TRL's logged metrics for a Tunix Gemma with LoRA, the reference being the base (LoRA off).

TRL 1.16's ``DPOTrainer`` + PEFT: each micro-batch is [chosen rows; rejected rows] (``data.pairs.collate``);
a row's log-probability is the sum of its completion tokens' log-probabilities; the reference's are the same
model's with the adapter disabled, without gradient. With the log-ratios ``c = logp_c - ref_c`` and
``r = logp_r - ref_r`` and ``d = c - r``, the micro-batch loss is the mean over pairs of the chosen
``loss_type``'s per-pair loss (a weighted sum for several). Log-probabilities come from the SFT step's fast
path (``step.hf.micro_batch_nll``: segment attention, decoder remat, chunked cross-entropy, never
[B, T, V] logits).
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from gemport.errors import RecipeError
from gemport.recipe import DPOLossFields, defaults
from gemport.step.hf import micro_batch_nll

METRICS: tuple[str, ...] = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                            "logps/chosen", "logps/rejected")
"""TRL's logged DPO metrics that ``dpo_loss`` returns, under TRL's names."""

# DPOConfig fields (gemport.recipe.DPOLossFields) that must keep DPOConfig's default, with why.
_REFUSED = {
    "ld_alpha": "length-desensitised log-probabilities are not ported yet",
    "f_divergence_type": "only DPO's reverse KL is ported",
    "use_weighting": "WPO weighting is not ported yet",
    "precompute_ref_log_probs": "reference log-probabilities are computed each step (base with LoRA off)",
    "sync_ref_model": "TR-DPO's reference synchronisation is not ported",
}


def _sigmoid(beta, c, r, n_c, n_r, smoothing, tau):
    return -jax.nn.log_sigmoid(beta * (c - r))


def _hinge(beta, c, r, n_c, n_r, smoothing, tau):
    return jax.nn.relu(1 - beta * (c - r))


def _ipo(beta, c, r, n_c, n_r, smoothing, tau):
    # Length-normalised, as TRL (the mean per completion token).
    return (c / jnp.maximum(n_c, 1) - r / jnp.maximum(n_r, 1) - 1 / (2 * beta)) ** 2


def _sigmoid_norm(beta, c, r, n_c, n_r, smoothing, tau):
    return -jax.nn.log_sigmoid(beta * (c / jnp.maximum(n_c, 1) - r / jnp.maximum(n_r, 1)))


def _robust(beta, c, r, n_c, n_r, smoothing, tau):
    z = beta * (c - r)
    return (-(1 - smoothing) * jax.nn.log_sigmoid(z) + smoothing * jax.nn.log_sigmoid(-z)) / (1 - 2 * smoothing)


def _exo_pair(beta, c, r, n_c, n_r, smoothing, tau):
    z = beta * (c - r)
    return (jax.nn.sigmoid(z) * (jax.nn.log_sigmoid(z) - jnp.log1p(-smoothing))
            + jax.nn.sigmoid(-z) * (jax.nn.log_sigmoid(-z) - jnp.log(smoothing)))


def _nca_pair(beta, c, r, n_c, n_r, smoothing, tau):
    return (-jax.nn.log_sigmoid(beta * c) - 0.5 * jax.nn.log_sigmoid(-beta * c)
            - 0.5 * jax.nn.log_sigmoid(-beta * r))


def _bco_pair(beta, c, r, n_c, n_r, smoothing, tau):
    return -jax.nn.log_sigmoid(beta * c) - jax.nn.log_sigmoid(-beta * r)


def _sppo_hard(beta, c, r, n_c, n_r, smoothing, tau):
    return (c - 0.5 / beta) ** 2 + (r + 0.5 / beta) ** 2


def _apo_zero(beta, c, r, n_c, n_r, smoothing, tau):
    return 1 - jax.nn.sigmoid(beta * c) + jax.nn.sigmoid(beta * r)


def _apo_down(beta, c, r, n_c, n_r, smoothing, tau):
    return jax.nn.sigmoid(beta * c) + 1 - jax.nn.sigmoid(beta * (c - r))


def _discopop(beta, c, r, n_c, n_r, smoothing, tau):
    z = beta * (c - r)
    mix = jax.nn.sigmoid(z / tau)
    return -jax.nn.log_sigmoid(z) * (1 - mix) + jnp.exp(-z) * mix


PAIR_LOSSES: dict[str, Callable[..., jax.Array]] = {
    "sigmoid": _sigmoid, "hinge": _hinge, "ipo": _ipo, "sigmoid_norm": _sigmoid_norm, "robust": _robust,
    "exo_pair": _exo_pair, "nca_pair": _nca_pair, "bco_pair": _bco_pair, "sppo_hard": _sppo_hard,
    "apo_zero": _apo_zero, "apo_down": _apo_down, "discopop": _discopop,
}
"""TRL 1.16's per-pair losses that gemport ports, by ``loss_type``: ``(beta, c, r, n_c, n_r, label_smoothing,
discopop_tau) -> [P]`` for log-ratios c, r [P] and completion token counts n_c, n_r [P]. Not ported (refused):
``aot`` and ``aot_unpaired`` (they sort log-ratios across the micro-batch), ``sft`` (a token-mean NLL term)."""


@dataclasses.dataclass(frozen=True)
class DPOLoss:
    """What a ``DPOConfig`` asks of the loss; built by ``from_dpo_config``.

    beta: the KL weight; loss_types: names in ``PAIR_LOSSES``; loss_weights: one per loss type;
    label_smoothing: for ``robust`` and ``exo_pair`` (TRL's sigmoid loss ignores it); discopop_tau.
    """

    beta: float = 0.1
    loss_types: tuple[str, ...] = ("sigmoid",)
    loss_weights: tuple[float, ...] = (1.0,)
    label_smoothing: float = 0.0
    discopop_tau: float = 0.05

    def __post_init__(self):
        unknown = [t for t in self.loss_types if t not in PAIR_LOSSES]
        if unknown:
            raise RecipeError(f"DPOConfig.loss_type={list(unknown)!r} is not ported; gemport has "
                              f"{sorted(PAIR_LOSSES)} (aot, aot_unpaired and sft are not)")
        if len(self.loss_weights) != len(self.loss_types):
            raise RecipeError(f"DPOConfig.loss_weights: {len(self.loss_weights)} weights for "
                              f"{len(self.loss_types)} loss types")
        if not self.beta > 0:
            raise RecipeError(f"DPOConfig.beta={self.beta!r}: expected a positive number")
        if "robust" in self.loss_types and not 0 <= self.label_smoothing < 0.5:
            raise RecipeError("DPOConfig.label_smoothing must be in [0, 0.5) for loss_type 'robust'")
        if "exo_pair" in self.loss_types and not 0 < self.label_smoothing < 1:
            raise RecipeError("DPOConfig.label_smoothing must be in (0, 1) for loss_type 'exo_pair'")

    def __call__(self, c: jax.Array, r: jax.Array, n_c: jax.Array, n_r: jax.Array) -> jax.Array:
        """Per-pair loss [P] from log-ratios c, r [P] and completion token counts n_c, n_r [P]."""
        return sum(w * PAIR_LOSSES[t](self.beta, c, r, n_c, n_r, self.label_smoothing, self.discopop_tau)
                   for t, w in zip(self.loss_types, self.loss_weights))


def from_dpo_config(config: Any) -> DPOLoss:
    """``DPOLoss`` from TRL's ``DPOConfig`` (or a dict of its fields; absent ones take the installed ``DPOConfig``'s
    defaults).

    Reads ``beta``, ``loss_type`` (a name or a list), ``loss_weights``, ``label_smoothing``, ``discopop_tau``;
    raises ``RecipeError`` naming the field for a loss type not in ``PAIR_LOSSES`` and for what is not ported:
    ``ld_alpha``, ``f_divergence_type`` other than ``reverse_kl``, ``use_weighting``,
    ``precompute_ref_log_probs``, ``sync_ref_model``.
    """
    f = DPOLossFields.from_config(config)
    for name, why in _REFUSED.items():
        default = defaults("DPOConfig")[name]
        if getattr(f, name) != default:
            raise RecipeError(f"DPOConfig.{name}={getattr(f, name)!r} is not reproduced by gemport ({why}); "
                              f"leave it at {default!r}")
    types = [f.loss_type] if isinstance(f.loss_type, str) else list(f.loss_type)
    weights = [1.0] * len(types) if f.loss_weights is None else [float(w) for w in f.loss_weights]
    return DPOLoss(beta=float(f.beta), loss_types=tuple(types), loss_weights=tuple(weights),
                   label_smoothing=float(f.label_smoothing), discopop_tau=float(f.discopop_tau))


def sequence_logps(model: nnx.Module, micro_batch: Mapping[str, jax.typing.ArrayLike]) -> jax.Array:
    """Summed completion log-probabilities float32 [R] of a micro-batch of ``data.Rows`` [R, T].

    Token t counts where ``loss_mask[t]`` (TRL's ``completion_mask``), predicted from position t - 1; computed
    by ``step.hf.micro_batch_nll`` (no [R, T, V] logits).
    """
    targets = jnp.asarray(micro_batch["loss_mask"], bool)[:, 1:]
    nll = micro_batch_nll(model, micro_batch)
    return -jnp.where(targets, nll, 0.0).sum(-1)


def without_lora(model: nnx.Module, reference: nnx.State | None = None) -> nnx.Module:
    """The reference of a DPO run: a copy of ``model`` whose LoRA factors are ``reference`` (an ``nnx.State`` of
    ``nnx.LoRAParam`` of the same structure, taken before training as values, not the model's own variables:
    ``jax.tree.map(jnp.copy, nnx.state(model, nnx.LoRAParam))``), or
    zero when None: the base's outputs (PEFT's disabled adapter). Shares every other array with ``model``, which
    is not changed."""
    graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
    lora = jax.tree.map(jnp.zeros_like, lora) if reference is None else reference
    return nnx.merge(graphdef, lora, rest, copy=True)


def preference_loss(logps: jax.Array, ref_logps: jax.Array, micro_batch: Mapping[str, jax.typing.ArrayLike],
                    loss: DPOLoss) -> tuple[jax.Array, dict[str, jax.Array]]:
    """TRL's DPO loss and metrics of one micro-batch from its rows' summed completion log-probabilities.

    logps, ref_logps: float32 [2P] of the policy and the reference (``sequence_logps``), chosen rows first;
    micro_batch: the ``data.Rows`` [2P, T] they were computed on (``data.pairs.collate``): its ``loss_mask``
    gives the completion lengths, its ``segment_ids`` which pairs are real (rows of padding pair with each
    other and are left out of every mean, so a short micro-batch can be padded to the step's shape).
    Returns (mean per-pair loss float32 [], {name in ``METRICS``: float32 []}): the means over the pairs of
    beta * log-ratio (rewards), of the chosen reward beating the rejected one (accuracies), of their
    difference (margins), and of the policy's log-probabilities (logps). Differentiable in ``logps``.
    """
    mask = jnp.asarray(micro_batch["loss_mask"], bool)
    half = mask.shape[0] // 2
    real = jnp.asarray(micro_batch["segment_ids"])[:half].any(-1)
    pairs = jnp.maximum(real.sum(), 1)
    ref_logps = jax.lax.stop_gradient(ref_logps)
    counts = mask[:, 1:].sum(-1)
    c, r = logps[:half] - ref_logps[:half], logps[half:] - ref_logps[half:]

    def mean(x):
        return jnp.where(real, x, 0.0).sum() / pairs

    value = mean(loss(c, r, counts[:half], counts[half:]))
    chosen, rejected = loss.beta * jax.lax.stop_gradient(c), loss.beta * jax.lax.stop_gradient(r)
    metrics = {
        "rewards/chosen": mean(chosen), "rewards/rejected": mean(rejected),
        "rewards/accuracies": mean((chosen > rejected).astype(jnp.float32)),
        "rewards/margins": mean(chosen - rejected),
        "logps/chosen": mean(jax.lax.stop_gradient(logps[:half])),
        "logps/rejected": mean(jax.lax.stop_gradient(logps[half:])),
    }
    return value, metrics


def dpo_loss(model: nnx.Module, micro_batch: Mapping[str, jax.typing.ArrayLike], loss: DPOLoss,
             reference: nnx.State | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """TRL's DPO loss of one micro-batch and its metrics (``preference_loss``), the policy being ``model`` (a
    Tunix Gemma with LoRA) and the reference ``without_lora(model, reference)`` (no gradient).

    micro_batch: ``data.Rows`` [2P, T] as ``data.pairs.collate`` lays out P pairs. reference: None for the base
    (LoRA off: TRL given ``peft_config``, a fresh adapter), or the LoRA factors the run started from (TRL given a
    ``PeftModel`` with an adapter, which it copies as its frozen ``"ref"`` adapter). Returns (float32 [],
    {name in ``METRICS``: float32 []}); differentiable in the LoRA factors.
    """
    logps = sequence_logps(model, micro_batch)
    ref_logps = sequence_logps(without_lora(model, reference), micro_batch)
    return preference_loss(logps, ref_logps, micro_batch, loss)
