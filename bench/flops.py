"""Model FLOPs of a trained token and the chips' bf16 peaks: the MFU count the step benches share
(``bench_train``, ``bench_tpu``), without JAX (``tests/step/test_speed_record.py`` recounts recorded figures)."""

from __future__ import annotations

import numpy as np

from gemport.mesh.dims import annotated
from gemport.specs import GemmaSpec


PEAK_TFLOPS = {"TPU v4": 275, "TPU v5 lite": 197, "TPU v5e": 197, "TPU v5p": 459, "TPU v5": 459, "TPU v6 lite": 918,
               "TPU v6e": 918, "H100": 989, "H200": 989, "B200": 2250}
"""Dense bf16 peak per device (TFLOP/s), by ``device_kind`` (the longest key it contains)."""


def peak_tflops(device_kind: str) -> float | None:
    keys = [k for k in PEAK_TFLOPS if k in device_kind]
    return PEAK_TFLOPS[max(keys, key=len)] if keys else None


def flops_per_token(spec: GemmaSpec, seq_len: int) -> float:
    """Model FLOPs of one trained token: 4 x weights passed (frozen weights: forward, and backward to the
    activations; the embedding as the logits' matmul) + 12 x keys seen x heads x head width per layer."""
    weights = sum(int(np.prod(shape)) for _, shape, _, _ in annotated(spec) if len(shape) > 1)
    attention = 0.0
    for i in range(spec.num_layers):
        window = spec.sliding_window if spec.layer_types[i] == "sliding" else seq_len
        seen = min(window, (seq_len + 1) / 2)
        attention += 12 * seen * spec.num_heads * spec.layer_head_dim(i)
    return 4 * weights + attention
