"""Logit agreement between a Tunix model and transformers on an HF checkpoint (needs the ``hf`` extra).

The one check that says a port changed nothing underneath: the same tokens through both stacks, the
largest logit difference reported beside the largest logit. ``trajectory`` (from `gemport.parity`) checks
training: the GPU recipe and the port, step by step.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from gemport.extras import require
from gemport.parity import Tolerances, Trajectory, trajectory


@dataclasses.dataclass(frozen=True)
class LogitReport:
    """How two models' logits agree on the same tokens.

    Attributes:
      max_abs_diff: max |tunix - transformers| over every position and vocabulary entry.
      max_abs_logit: max |transformers logit|, for scale.
      shape: (batch, seq_len, vocab) of the compared logits.
      atol: the tolerance ``ok`` is judged by.
    """

    max_abs_diff: float
    max_abs_logit: float
    shape: tuple[int, int, int]
    atol: float

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.atol

    def __str__(self) -> str:
        verdict = "agree" if self.ok else "DISAGREE"
        return (f"logits {verdict}: max |tunix - transformers| = {self.max_abs_diff:.3g} (atol {self.atol:g}) "
                f"over {self.shape[0]}x{self.shape[1]} tokens x {self.shape[2]} vocab; max |logit| "
                f"{self.max_abs_logit:.3g}")


def transformers_model(hf_dir: str | Path, *, adapter_dir: str | Path | None = None):
    """The transformers model of ``hf_dir`` (its ``architectures[0]``) in float32 with eager attention, plus
    the PEFT adapter at ``adapter_dir`` if given."""
    transformers = require("transformers", "verifying against transformers")
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    cls = getattr(transformers, (config.get("architectures") or ["AutoModelForCausalLM"])[0])
    model = cls.from_pretrained(hf_dir, dtype="float32", attn_implementation="eager")
    if adapter_dir is not None:
        PeftModel = require("peft", "verifying a PEFT adapter").PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    return model.eval()


def tunix_logits(model, tokens: np.ndarray) -> np.ndarray:
    """float32 logits [B, T, V] of a Tunix Gemma model on ``tokens`` int32 [B, T], with a causal mask."""
    import jax.numpy as jnp

    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    logits, _ = model(jnp.asarray(tokens), positions, None, jnp.tril(jnp.ones((b, t, t), bool)))
    return np.asarray(logits, np.float32)


def compare_logits(hf_dir: str | Path, tunix_model, *, adapter_dir: str | Path | None = None,
                   tokens: np.ndarray | None = None, seq_len: int = 16, seed: int = 0,
                   atol: float = 1e-4) -> LogitReport:
    """Run the same tokens through transformers on ``hf_dir`` (and PEFT ``adapter_dir``) and ``tunix_model``.

    Args:
      hf_dir: an HF checkpoint (e.g. the base, or the output of ``export_merged``).
      tunix_model: a Tunix Gemma model, with or without Qwix LoRA.
      adapter_dir: a PEFT adapter to put on the transformers model (e.g. the output of ``export_peft``).
      tokens: int32 [B, T]; default two random rows of ``seq_len`` tokens drawn with ``seed``.
      atol: the max-abs difference ``LogitReport.ok`` accepts.
    """
    torch = require("torch", "verifying against transformers")
    hf = transformers_model(hf_dir, adapter_dir=adapter_dir)
    if tokens is None:
        vocab = hf.config.get_text_config().vocab_size
        tokens = np.random.default_rng(seed).integers(0, vocab, (2, seq_len), dtype=np.int32)
    with torch.no_grad():
        expected = hf(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()
    got = tunix_logits(tunix_model, tokens)
    return LogitReport(float(np.abs(got - expected).max()), float(np.abs(expected).max()), expected.shape, atol)


__all__ = [
    "LogitReport",
    "Tolerances",
    "Trajectory",
    "compare_logits",
    "trajectory",
    "transformers_model",
    "tunix_logits",
]
