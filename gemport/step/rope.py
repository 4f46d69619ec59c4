"""RoPE with its inverse frequencies rounded once from float64, on every device: Tunix's rotation, exact on a TPU.

Tunix's Gemma models compute RoPE's timescales, ``base_frequency ** (2 i / head_dim)``, in the traced program, so
a TPU computes them with its float32 power, whose error is about 80 times the CPU's (4.9e-6 relative on a v5e,
``tools/tpu/op_precision.py``). An angle is the position over its timescale, so its error grows with the position:
about 1e-2 radians at position 4096 on the fastest frequency, more than bfloat16's rounding of the rotated
queries and keys. A float32 miniature of Gemma 4 31B moves its logits by 1.7e-3 under timescales 2.4e-6 off (the
chip's, measured), the size of the float32 gap a v5e showed against the CPU.

Here the angles are HF's: the position times ``inv_freq``, a constant computed on the host (the exponent in
float32 as HF rounds it, the power and the scale factor's division exact, rounded once). A product by a constant
is one IEEE rounding on any device, and XLA leaves it as written; a division by a constant it may rewrite as a
product by the constant's reciprocal in one compiled copy of the forward and not in another (a DPO step's policy and
reference, a forward and its recompute under remat), which would break their equality (measured: DPO's first
rewards 3.8e-6 where 0, and Gemma 4 E4B's trained adapter 6x further from TRL's float64 run).

``exact_rope`` puts these in place of Tunix's ``apply_rope`` (Gemma 3's and Gemma 4's, same arguments) while it is
open; ``step.precision.with_precision`` traces the trained step under it, and ``check.verify`` its Tunix logits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from gemport._src import upstream


def inv_freq(head_dim: int, base_frequency: float, rope_proportion: float = 1.0,
             scale_factor: float = 1.0) -> np.ndarray:
    """RoPE's inverse frequencies float32 [head_dim // 2], HF's ``inv_freq``: ``base_frequency ** -e / scale_factor``
    for e = 2 i / head_dim rounded to float32 (as HF and Tunix round it), the rest in float64, rounded once; past
    ``rope_proportion`` of the angles (Gemma 4's partial rotation), 0, so those angles are 0.

    Example:
      >>> inv_freq(8, 10_000.0)
      array([1.   , 0.1  , 0.01 , 0.001], dtype=float32)
    """
    if scale_factor < 1.0:
        raise ValueError(f"scale_factor must be >= 1.0, got {scale_factor}")
    rotated = int(rope_proportion * head_dim // 2)
    exponent = (2 * np.arange(rotated) / head_dim).astype(np.float32).astype(np.float64)
    frequencies = np.zeros(head_dim // 2)
    frequencies[:rotated] = float(base_frequency) ** -exponent / float(scale_factor)
    return frequencies.astype(np.float32)


def rotate(inputs: jax.Array, positions: jax.Array, frequencies: np.ndarray) -> jax.Array:
    """``inputs`` [B, L, N, H] rotated pairwise (the first half of H with the second) by the angles ``positions``
    [B, L] times ``frequencies`` float32 [H // 2] (``inv_freq``); returns [B, L, N, H] in ``inputs``' dtype."""
    angles = (positions[..., None].astype(jnp.float32) * jnp.asarray(frequencies))[..., None, :]
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    first, second = jnp.split(inputs, 2, axis=-1)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1).astype(inputs.dtype)


def gemma3_rope(inputs, positions, *, head_dim: int, base_frequency: float, scale_factor: float = 1.0):
    """Tunix Gemma 3's ``apply_rope`` (same arguments) at ``inv_freq``'s angles."""
    return rotate(inputs, positions, inv_freq(head_dim, base_frequency, scale_factor=scale_factor))


def gemma4_rope(inputs, positions, *, base_frequency: float, scale_factor: float = 1.0, rope_proportion: float = 1.0):
    """Tunix Gemma 4's ``apply_rope`` (same arguments; the head width is ``inputs``') at ``inv_freq``'s angles."""
    return rotate(inputs, positions, inv_freq(inputs.shape[-1], base_frequency, rope_proportion, scale_factor))


@contextlib.contextmanager
def exact_rope() -> Iterator[None]:
    """While open, Tunix's Gemma 3 and Gemma 4 models (and gemport's attention over them) rotate with
    ``gemma3_rope`` and ``gemma4_rope``: what a step traced inside computes, on any device."""
    with upstream.tunix_rope(gemma3=gemma3_rope, gemma4=gemma4_rope):
        yield


__all__ = ["exact_rope", "gemma3_rope", "gemma4_rope", "inv_freq", "rotate"]
