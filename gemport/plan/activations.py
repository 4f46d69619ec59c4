"""What one LoRA train step adds per device beyond the resident state: gradients, activations, logits.

Autodiff keeps, for every layer, the tensors its backward pass reads (the residuals); the backward pass of
one layer at a time then needs its own temporaries; the loss needs the (B, T, V) logits in float32 and a
few copies of that size (softcap, log-softmax, its gradient). Tunix computes attention as explicit scores
(B, T, N, T), softmax in float32 on Gemma 4, over the full T x T even on sliding-window layers (the window
is a mask). With Tunix's ``remat_config`` (``RematConfig.DECODER``: each decoder layer rematerialised;
``BLOCK``: its attention and its MLP separately) a layer keeps only its inputs and recomputes the rest
during its backward pass, so only one layer's (or block's) residuals are live at a time.

Sizes per device follow Tunix's activation annotations: rows (B) over fsdp, model width, heads and MLP
width over tp (``act_btd = ("fsdp", None, "tp")``, ``act_btnh``, ``act_btf``), logits' vocabulary over tp
(the embedding's tp axis).

How many tensors of each size a layer keeps is counted from what XLA's buffer assignment holds for Tunix's
Gemma 4 and Gemma 3 on CPU (``gemport/mesh/compiled.py``), not derived from first principles; the tests check the
totals against ``jax``'s compiled memory analysis.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from gemport.errors import MeshError
from gemport.specs import GemmaSpec
from gemport.step.hf import LossFn, segment_loss
from gemport.step.attention import BLOCK
from gemport.step.chunked_loss import CHUNK, VOCAB_SLICE, num_slices

REMAT = ("none", "block", "decoder", "projections")

# Tensors one layer keeps for its backward pass, in units of one tensor per token of the given width:
# attention scores (N x T per token, float32 on Gemma 4), MLP width F, model width D, head widths (Q, K, V).
_KEPT = {"scores": 1.25, "mlp": 3.0, "model": 12.0, "heads": 3.0}
# Temporaries of the backward pass of the one layer being differentiated.
_BACKWARD = {"scores": 2.0, "mlp": 1.0, "model": 2.0}
# Float32 (B, T, V) tensors of the logits and the loss: logits, softcapped logits, log-softmax, gradient.
_LOGIT_COPIES = 4
# Model-width tensors per layer kept under remat: the layer's inputs (decoder, projections), or each block's (block).
_REMAT_KEPT = {"decoder": 2.0, "block": 5.0, "projections": 2.0}
# gemport's default step (``step.segment_loss``) holds float32 blocks of logits [rows, CHUNK, VOCAB_SLICE], not
# (B, T, V): the block, its exponentials and its cotangent.
_BLOCK_COPIES = 3


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """Per-device bytes of one train step beyond params, LoRA params and optimizer moments.

    Attributes:
      batch, seq_len, remat: the step planned (global batch B, sequence length T, remat: Tunix's policy, or
        gemport's "projections", ``step.remat.SAVED``).
      gradient_bytes: one gradient per trainable param (shaped and sharded like it).
      activation_bytes: what the layers keep for the backward pass plus one layer's backward temporaries.
      logits_bytes: the float32 logits (B, T, V) and the loss's temporaries of that size.
      batch_bytes: the input rows (tokens, positions, loss mask; segment ids, or Tunix's attention mask
        [B, T, T]).
      loss_fn: the step's loss: gemport's default (``step.segment_loss``), or ``step.tunix_loss`` (Tunix's own
        attention and logits).
      gathered_bytes: under fsdp, the weights gathered whole over fsdp for a dot (``gemport.plan.memory``); 0
        without fsdp.
      scanned_bytes: with the decoder scanned in blocks (``step.scan``), one block's weights, which the scan's
        choice of each layer's weights copies (``gemport.plan.memory``); 0 where the decoder keeps its loop.
    """

    batch: int
    seq_len: int
    remat: str
    gradient_bytes: int
    activation_bytes: int
    logits_bytes: int
    batch_bytes: int
    loss_fn: LossFn = segment_loss
    gathered_bytes: int = 0
    scanned_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return (self.gradient_bytes + self.activation_bytes + self.logits_bytes + self.batch_bytes
                + self.gathered_bytes + self.scanned_bytes)


def _layer_widths(spec: GemmaSpec, layer: int, seq_len: int, tp: int, tiled: bool) -> dict[str, float]:
    """Per-token elements on one device of each kind of tensor a layer computes; attention scores are one
    [T, S] row per head under Tunix's attention, one tile row (``step.attention.BLOCK`` keys) under gemport's."""
    keys = min(seq_len, BLOCK) if tiled else seq_len
    head_dim, kv_heads = spec.layer_head_dim(layer), spec.layer_kv_heads(layer)
    kv = 0 if spec.layer_kv_shared(layer) else (1 if spec.layer_k_eq_v(layer) else 2) * kv_heads * head_dim
    mlp = spec.layer_mlp(layer) + spec.experts_per_token * spec.expert_dim + spec.per_layer_input_dim
    return {
        "scores": spec.num_heads * keys / tp,
        "mlp": mlp / tp,
        "model": spec.hidden / tp,
        "heads": (spec.num_heads * head_dim + kv) / tp,
    }


def step_memory(
    spec: GemmaSpec,
    fsdp: int,
    tp: int,
    *,
    batch: int,
    seq_len: int,
    remat: str = "none",
    trainable_bytes: int,
    compute_dtype="bfloat16",
    loss_fn: LossFn = segment_loss,
    gathered_bytes: int = 0,
    scanned_bytes: int = 0,
    projections: float = 0,
) -> StepMemory:
    """Per-device bytes of one train step of ``spec`` on an (fsdp, tp) mesh for ``batch`` rows of ``seq_len``.

    Args:
      batch: rows per step (all devices together); fsdp splits them, so it must divide by fsdp.
      seq_len: tokens per row T.
      remat: Tunix's ``remat_config``: ``"none"``, ``"block"`` or ``"decoder"``; or ``"projections"``, decoder
        remat keeping each layer's adapted projections' products too (``step.remat.SAVED``).
      trainable_bytes: per-device bytes of the trainable params (their gradients are as large).
      compute_dtype: the compute dtype of activations (Tunix Gemma 4's ``dtype``; Gemma 3 computes in its param
        dtype). Gemma 4 takes attention softmax in float32 whatever it is; logits are float32.
      loss_fn: ``step.segment_loss``, the step ``step.train_step`` runs by default (segment attention in tiles,
        the loss in blocks of logits); ``step.tunix_loss``: Tunix's own attention ([B, T, N, S] scores) and
        [B, T, V] logits.
      gathered_bytes: per-device bytes of the weights fsdp gathers whole for the dot that needs them at the
        peak (``gemport.plan.memory`` counts them from the params' annotations); carried as they are.
      projections: under remat ``"projections"``, the elements per token one device keeps of every layer's
        adapted projections' products (``gemport.plan.memory`` counts them from the LoRA factors), in
        ``compute_dtype``.
    """
    if remat not in REMAT:
        raise MeshError(f"remat={remat!r}: expected one of {', '.join(REMAT)} (Tunix's RematConfig)")
    if batch < 1 or seq_len < 1:
        raise MeshError(f"batch={batch}, seq_len={seq_len}: both must be positive")
    if batch % fsdp:
        raise MeshError(f"batch={batch} does not divide over fsdp={fsdp}: each fsdp shard takes whole rows")
    tiled = loss_fn is segment_loss
    act = np.dtype(compute_dtype).itemsize
    score = 4 if spec.family == "gemma4" or tiled else act
    tokens = batch // fsdp * seq_len
    layers = [_layer_widths(spec, i, seq_len, tp, tiled) for i in range(spec.num_layers)]

    def size(widths, counts):
        return sum(counts.get(k, 0) * w * (score if k == "scores" else act) for k, w in widths.items())

    kept = [size(w, _KEPT) for w in layers]
    backward = max(size(w, _BACKWARD) for w in layers)
    if remat == "none":
        per_token = sum(kept) + backward
    else:
        saved = sum(_REMAT_KEPT[remat] * w["model"] * act for w in layers)
        if remat == "projections":
            saved += projections * act
        if remat != "block":
            live = max(kept)
        else:
            attention = {**_KEPT, "mlp": 0, "model": _KEPT["model"] / 2}
            mlp = {"mlp": _KEPT["mlp"], "model": _KEPT["model"] / 2}
            live = max(max(size(w, attention), size(w, mlp)) for w in layers)
        per_token = saved + live + backward
    rows = batch // fsdp
    vocab = -(-spec.vocab // tp)
    if not tiled:
        logits = tokens * _LOGIT_COPIES * vocab * 4
        # int32 tokens and positions, bool loss mask and attention mask.
        batch_bytes = rows * seq_len * (4 + 4 + 1 + seq_len)
    else:
        block = rows * min(CHUNK, seq_len) * -(-spec.vocab // num_slices(spec.vocab, VOCAB_SLICE) // tp)
        logits = _BLOCK_COPIES * block * 4
        # int32 tokens, positions and segment ids, bool loss mask.
        batch_bytes = rows * seq_len * (4 + 4 + 4 + 1)
    return StepMemory(
        batch=batch,
        seq_len=seq_len,
        remat=remat,
        gradient_bytes=trainable_bytes,
        activation_bytes=int(tokens * per_token),
        logits_bytes=int(logits),
        batch_bytes=batch_bytes,
        loss_fn=loss_fn,
        gathered_bytes=gathered_bytes,
        scanned_bytes=scanned_bytes,
    )
