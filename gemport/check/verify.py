"""Logit agreement between a Tunix model and transformers on an HF checkpoint (needs the ``hf`` extra).

The one check that says a port changed nothing underneath: the same tokens through both stacks, the
largest logit difference reported beside the largest logit. `compare_vllm` checks serving: vLLM's greedy
continuations and top logprobs on an export against transformers (+ PEFT) and Tunix. Training is checked a
layer up, by `gemport.check.parity`: the GPU recipe and the port, step by step.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import jax
import jax.numpy as jnp

from gemport.check.vllm_offline import Served, serve_vllm
from gemport._src.extras import require
from gemport.errors import VerifyError
from gemport.specs import GemmaSpec
from gemport.step.precision import matmul_precision
from gemport.step.rope import exact_rope


# How far beyond the floor two correct implementations may land. The floor is a maximum over few tokens, so it
# varies by a few times with the tokens and weights; Tunix measured 0.7-2.3x it on a checkpoint, up to 5.4x on
# a merged export (the merge rounds W + BA once more); a corrupted tensor is far beyond.
WITHIN = 10.0


@dataclasses.dataclass(frozen=True)
class LogitReport:
    """How two models' logits agree on the same tokens, judged against a floor measured on those tokens.

    Attributes:
      max_abs_diff: max |tunix - transformers| over every position and vocabulary entry (in bfloat16: Tunix in
        bfloat16 against transformers in float32, the floor's reference).
      max_abs_logit: max |transformers logit|, for scale.
      shape: (batch, seq_len, vocab) of the compared logits.
      floor: the same distance between two correct runs of transformers (``floor_name``), at least one float32
        unit of the largest logit.
      floor_name: what the floor compares, e.g. ``"transformers eager vs sdpa, float32"``.
      distance_name: what ``max_abs_diff`` compares.
      within: ``ok`` when ``max_abs_diff <= within * floor``.
      atol: a fixed tolerance chosen instead of the floor's multiple, or None.
    """

    max_abs_diff: float
    max_abs_logit: float
    shape: tuple[int, int, int]
    floor: float
    floor_name: str
    within: float = WITHIN
    atol: float | None = None
    distance_name: str = "tunix - transformers"

    @property
    def multiple(self) -> float:
        """``max_abs_diff`` in units of the floor."""
        return self.max_abs_diff / self.floor

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= (self.atol if self.atol is not None else self.within * self.floor)

    def __str__(self) -> str:
        verdict = "agree" if self.ok else "DISAGREE"
        rule = f"atol {self.atol:g}" if self.atol is not None else f"agree within {self.within:g} x"
        return (f"logits {verdict}: max |{self.distance_name}| = {self.max_abs_diff:.3g} = {self.multiple:.3g} x the "
                f"floor {self.floor:.3g} ({self.floor_name}; {rule}) over {self.shape[0]}x{self.shape[1]} tokens x "
                f"{self.shape[2]} vocab; max |logit| {self.max_abs_logit:.3g}")


def transformers_model(hf_dir: str | Path, *, adapter_dir: str | Path | None = None, dtype: str = "float32",
                       attention: str = "eager"):
    """The transformers model of ``hf_dir`` (its ``architectures[0]``) in ``dtype`` with ``attention``, plus
    the PEFT adapter at ``adapter_dir`` if given (PEFT keeps it in float32 on a bfloat16 base)."""
    transformers = require("transformers", "verifying against transformers")
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    cls = getattr(transformers, (config.get("architectures") or ["AutoModelForCausalLM"])[0])
    model = cls.from_pretrained(hf_dir, dtype=dtype, attn_implementation=attention)
    if adapter_dir is not None:
        PeftModel = require("peft", "verifying a PEFT adapter").PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    return model.eval()


def tunix_logits(model, tokens: np.ndarray) -> np.ndarray:
    """float32 logits [B, T, V] of a Tunix Gemma model on ``tokens`` int32 [B, T], with a causal mask, its
    products at the precision of its dtype and its RoPE at the host's inverse frequencies (``step.precision``:
    float32 products for a float32 model, which a TPU's default would multiply in one bfloat16 pass; ``step.rope``)."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    with exact_rope(), jax.default_matmul_precision(matmul_precision(model_dtype(model) == "bfloat16", None)):
        logits, _ = model(jnp.asarray(tokens), positions, None, jnp.tril(jnp.ones((b, t, t), bool)))
    return np.asarray(logits, np.float32)


def model_dtype(tunix_model) -> str:
    """The dtype of a Tunix model's base weights (its embedding), e.g. ``"bfloat16"``."""
    return str(tunix_model.embedder.input_embedding.get_value().dtype)


def compare_logits(hf_dir: str | Path, tunix_model, *, adapter_dir: str | Path | None = None,
                   tokens: np.ndarray | None = None, seq_len: int = 16, seed: int = 0, dtype: str | None = None,
                   within: float = WITHIN, atol: float | None = None) -> LogitReport:
    """Run the same tokens through transformers on ``hf_dir`` (and PEFT ``adapter_dir``) and ``tunix_model``, and
    judge the distance against a floor measured on the same tokens.

    In float32 the floor is transformers eager against transformers sdpa: two correct attention kernels. In
    bfloat16 both sides run in bfloat16, and Tunix's distance from transformers' float32 run is judged against
    transformers' own (its bfloat16 run against its float32 run): the rounding of the dtype itself, which two
    bfloat16 runs each add independently. One float32 unit of the largest logit bounds the floor from below.

    Args:
      hf_dir: an HF checkpoint (e.g. the base, or the output of ``export_merged``).
      tunix_model: a Tunix Gemma model, with or without Qwix LoRA, in ``dtype``.
      adapter_dir: a PEFT adapter to put on the transformers model (e.g. the output of ``export_peft``).
      tokens: int32 [B, T]; default two random rows of ``seq_len`` tokens drawn with ``seed``.
      dtype: ``"float32"`` or ``"bfloat16"``; default the Tunix model's (``model_dtype``).
      within: ``LogitReport.ok`` accepts up to this multiple of the floor.
      atol: a fixed max-abs tolerance instead (the floor is still reported).

    Returns:
      A `LogitReport`: ``ok``, the distance, the floor and what it compares, printed as one line.

    Example (``checkpoint``: a tiny Gemma 3 saved by transformers):

      >>> from gemport import compare_logits, load_model
      >>> report = compare_logits(checkpoint, load_model(checkpoint, param_dtype="float32"))
      >>> report.ok
      True
    """
    torch = require("torch", "verifying against transformers")
    dtype = dtype or model_dtype(tunix_model)
    if dtype not in ("float32", "bfloat16"):
        raise VerifyError(f"compare_logits: dtype {dtype!r}; verify float32 or bfloat16")

    def logits(**kwargs):
        hf = transformers_model(hf_dir, adapter_dir=adapter_dir, **kwargs)
        with torch.no_grad():
            return hf(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()

    if tokens is None:
        vocab = GemmaSpec.from_hf(hf_dir).vocab
        tokens = np.random.default_rng(seed).integers(0, vocab, (2, seq_len), dtype=np.int32)
    # One transformers model at a time, so that the host holds one beside the Tunix model.
    expected = logits()
    if dtype == "float32":
        other, floor_name, distance_name = logits(attention="sdpa"), "transformers eager vs sdpa, float32", \
            "tunix - transformers"
    else:
        other, floor_name, distance_name = logits(dtype=dtype), "transformers bfloat16 vs float32", \
            "tunix bfloat16 - transformers float32"
    unit = float(np.abs(expected).max()) * float(np.finfo(np.float32).eps)
    floor = max(float(np.abs(other - expected).max()), unit)
    got = tunix_logits(tunix_model, tokens)
    return LogitReport(float(np.abs(got - expected).max()), float(np.abs(expected).max()), expected.shape, floor,
                       floor_name, within, atol, distance_name)


@dataclasses.dataclass(frozen=True)
class ContinuationReport:
    """How an engine's greedy continuations and top logprobs agree with a reference model's on the same tokens.

    The reference reads each prompt followed by the engine's continuation (teacher forcing), so every position
    is compared after the same prefix: a position agrees when the engine's token is the reference's greedy
    choice (up to ``atol`` in log-probability: a tie is either token) and each of the engine's top logprobs is
    the reference's within ``atol``.

    Attributes:
      engine, reference: e.g. ``"vLLM 0.32.0"`` and ``"transformers + peft"``.
      max_abs_diff: max |engine - reference| log-probability over the engine's top entries at every position.
      shape: (prompts, generated tokens per prompt).
      atol: the tolerance ``ok`` is judged by: ``within`` x ``floor``, or a fixed one chosen instead.
      first: ``None``, or what differs first (prompt-major): ``"prompt 1, position 3: ..."``.
      floor: the same distance between two correct runs of the reference's peer on the same tokens
        (``floor_name``), or None when ``atol`` was fixed without one.
      floor_name: what the floor compares, e.g. ``"transformers eager vs sdpa, float32"``.
      within: the multiple of ``floor`` that ``atol`` is, or None when ``atol`` is fixed.
    """

    engine: str
    reference: str
    max_abs_diff: float
    shape: tuple[int, int]
    atol: float
    first: str | None
    floor: float | None = None
    floor_name: str | None = None
    within: float | None = None

    @property
    def ok(self) -> bool:
        return self.first is None

    def __str__(self) -> str:
        verdict = "agree" if self.ok else f"DISAGREE at {self.first}"
        if self.floor is None:
            judged = f"(atol {self.atol:g})"
        else:
            rule = f"agree within {self.within:g} x" if self.within is not None else f"atol {self.atol:g}"
            judged = (f"= {self.max_abs_diff / self.floor:.3g} x the floor {self.floor:.3g} ({self.floor_name}; "
                      f"{rule})")
        return (f"{self.engine} and {self.reference} {verdict}: greedy continuations of {self.shape[0]} prompts x "
                f"{self.shape[1]} tokens, max |top logprob difference| {self.max_abs_diff:.3g} {judged}")


def compare_continuations(served: Served, reference: np.ndarray, *, name: str, atol: float | None = None,
                          floor: float | None = None, floor_name: str | None = None,
                          within: float | None = None) -> ContinuationReport:
    """Judge ``served`` against ``reference`` log-probabilities float [B, P + T, V] of each prompt (P tokens)
    followed by its T served tokens (position P - 1 + j predicts served token j), within ``within`` x ``floor``
    or a fixed ``atol``: one of the two is given (no tolerance holds for every checkpoint's magnitudes).

    Args:
      atol: a fixed tolerance in log-probability, chosen instead of a multiple of a floor.
      floor, floor_name: the floor measured on these tokens (`logprob_floor`), reported beside the distance.
      within: judge within this multiple of ``floor``.
    """
    if within is not None:
        if floor is None:
            raise VerifyError("compare_continuations: within= judges against a floor: pass floor=")
        atol = within * floor
    elif atol is None:
        raise VerifyError("compare_continuations: pass within= and floor= (logprob_floor on these tokens), or a "
                         "fixed atol=")
    b, t = served.tokens.shape
    start = reference.shape[1] - t - 1
    first, worst = None, 0.0
    for i in range(b):
        for j in range(t):
            lp = reference[i, start + j]
            token, greedy = int(served.tokens[i, j]), int(lp.argmax())
            diffs = {k: abs(v - lp[k]) for k, v in served.top_logprobs[i][j].items()}
            worst = max(worst, *diffs.values())
            if first is not None:
                continue
            if lp[token] < lp[greedy] - atol:
                first = (f"prompt {i}, position {j}: {served.engine} chose token {token} (log-probability "
                         f"{lp[token]:.6g} in {name}), {name} token {greedy} ({lp[greedy]:.6g})")
            elif max(diffs.values()) > atol:
                k = max(diffs, key=diffs.get)
                first = (f"prompt {i}, position {j}: token {k} has log-probability "
                         f"{served.top_logprobs[i][j][k]:.6g} in {served.engine}, {lp[k]:.6g} in {name}")
    return ContinuationReport(served.engine, name, float(worst), (b, t), atol, first, floor, floor_name, within)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-probabilities of logits [..., V]."""
    x = np.asarray(logits, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def logprob_floor(served: Served, a: np.ndarray, b: np.ndarray, logits: np.ndarray) -> float:
    """The floor for `compare_continuations`: max |a - b| over the entries ``served`` reports (every position's
    top log-probabilities), ``a`` and ``b`` two correct runs' log-probabilities float [B, P + T, V] of the same
    tokens; at least one float32 unit of the largest |logit| at those positions (``logits`` [B, P + T, V]),
    the least a log-probability computed from float32 logits is known to."""
    b_, t = served.tokens.shape
    start = a.shape[1] - t - 1
    worst = max(abs(float(a[i, start + j, k]) - float(b[i, start + j, k]))
                for i in range(b_) for j in range(t) for k in served.top_logprobs[i][j])
    unit = float(np.abs(logits[:, start:start + t]).max()) * float(np.finfo(np.float32).eps)
    return max(worst, unit)


def compare_vllm(hf_dir: str | Path, *, adapter_dir: str | Path | None = None, tunix_model=None,
                 prompts: np.ndarray | None = None, num_prompts: int = 3, seq_len: int = 16, max_tokens: int = 8,
                 seed: int = 0, within: float = WITHIN, atol: float | None = None, dtype: str = "float32",
                 python: str | None = None) -> list[ContinuationReport]:
    """Serve ``hf_dir`` (with the PEFT adapter ``adapter_dir`` as a LoRA request) on vLLM and compare its greedy
    continuations and top-5 logprobs with transformers (+ PEFT) and, if given, ``tunix_model``, judged against a
    floor measured on the same tokens.

    The references compute in float32 with transformers' eager attention. In float32 the floor is the
    reference against transformers with sdpa attention (two correct kernels); with ``dtype="bfloat16"`` (vLLM
    in bfloat16), transformers' own bfloat16 run against its float32 run (the dtype's rounding, which vLLM adds
    as well). Both over the entries vLLM reports (`logprob_floor`).

    Args:
      hf_dir: a merged export, or the base of ``adapter_dir``.
      adapter_dir: a PEFT adapter (e.g. the output of ``export_peft``) served on ``hf_dir``.
      tunix_model: a Tunix model computing what the export should (e.g. the base with the Qwix LoRA).
      prompts: int [B, P] token ids; default ``num_prompts`` random rows of ``seq_len`` tokens drawn with ``seed``.
      max_tokens: tokens generated per prompt.
      within: agree within this multiple of the floor (in log-probability).
      atol: a fixed tolerance in log-probability instead (the floor is still reported).
      dtype: vLLM's dtype; the references run in float32.
      python: the interpreter with vLLM (`gemport.check.vllm_offline.vllm_python`).

    Returns:
      One `ContinuationReport` per reference: transformers first, then Tunix.
    """
    torch = require("torch", "verifying against transformers")
    if dtype not in ("float32", "bfloat16"):
        raise VerifyError(f"compare_vllm: dtype {dtype!r}; verify float32 or bfloat16")
    if prompts is None:
        vocab = GemmaSpec.from_hf(hf_dir).vocab
        prompts = np.random.default_rng(seed).integers(0, vocab, (num_prompts, seq_len), dtype=np.int32)
    served = serve_vllm([(hf_dir, [adapter_dir])], prompts, max_tokens=max_tokens, dtype=dtype, python=python)[0][0]
    tokens = np.concatenate([prompts, served.tokens.astype(prompts.dtype)], axis=1)

    def logits(**kwargs):
        # Loaded after vLLM is done, one at a time, so that the host holds one model at a time.
        hf = transformers_model(hf_dir, adapter_dir=adapter_dir, **kwargs)
        with torch.no_grad():
            return hf(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()

    expected = logits()
    if dtype == "float32":
        other, floor_name = logits(attention="sdpa"), "transformers eager vs sdpa, float32"
    else:
        other, floor_name = logits(dtype=dtype), "transformers bfloat16 vs float32"
    reference = log_softmax(expected)
    floor = logprob_floor(served, reference, log_softmax(other), expected)
    judge = dict(floor=floor, floor_name=floor_name, **({"atol": atol} if atol is not None else {"within": within}))
    name = "transformers + peft" if adapter_dir is not None else "transformers"
    reports = [compare_continuations(served, reference, name=name, **judge)]
    if tunix_model is not None:
        reports.append(compare_continuations(served, log_softmax(tunix_logits(tunix_model, tokens)), name="tunix",
                                             **judge))
    return reports


__all__ = [
    "ContinuationReport",
    "LogitReport",
    "WITHIN",
    "compare_continuations",
    "compare_logits",
    "compare_vllm",
    "log_softmax",
    "logprob_floor",
    "model_dtype",
    "transformers_model",
    "tunix_logits",
]
