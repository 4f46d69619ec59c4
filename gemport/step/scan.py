"""Decoder remat as a loop: a Tunix Gemma's layers run as one ``lax.scan`` over blocks of its attention pattern.

Tunix runs its decoder layers in a Python loop, so the train step's program holds every layer's forward pass and
its recomputation and backward pass: compile time grows with depth (about 150 s for 26 layers on a TPU host, 10 to
36 minutes for 60 when this project's CPU host compiles for a v5p-8). Gemma's layers repeat a pattern (Gemma 3 and
4: five sliding layers, then one global), so under decoder remat the layers of whole patterns ("blocks") run here
as one scan over the blocks: the program holds one block, whatever the depth (docs/benchmarks.md, "Compile time at
depth", has the figures).

The scan reads each block's weights where they are: layer k of block j is merged from the state of layer
``j * period + k``, chosen by ``lax.switch`` on j, so no stacked copy of the weights is made. Each layer is one
``jax.checkpoint`` of that choice and the layer's block keeping what the remat keeps (``step.remat.SAVED``): under
"decoder" nothing, so its backward pass keeps the layer's input and recomputes the rest, the choice of weights
included (saved per block they would be a copy of the decoder's weights), as Tunix's decoder remat recomputes a
layer; under "projections" also the adapted projections' products. Layers past the last whole block run after the
scan, each in the same ``jax.checkpoint``.

The values and gradients are those of the unrolled decoder: the same layers, on the same weights, in the same order.
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from gemport._src import upstream
from gemport.errors import TrainingError
from gemport.lora import LoraLayout, LoraSpec
from gemport.specs import GemmaSpec
from gemport.step.remat import SAVED

MIN_BLOCKS = 2
"""A decoder of fewer whole blocks keeps its loop: scanning one block would compile the same program."""


def decoder_period(layers: list[tuple[nnx.GraphDef, nnx.State]]) -> int:
    """The shortest period p of a decoder, layer i and layer i % p alike (the same graph, attention type included,
    and states of the same structure, shapes and dtypes); at most the depth.

    layers: each layer's ``nnx.split``. A 26-layer Gemma 3 has period 6 (four whole blocks, two layers past them).
    """

    def alike(i, k):
        (gi, si), (gk, sk) = layers[i], layers[k]
        # Qwix matches its rules against module paths, whose layer index differs: a rule alike for every layer
        # (no per-layer alpha, ``scanned_decoder`` checks) reads the same from block 0's paths.
        return (upstream.graph_without_module_paths(gi) == upstream.graph_without_module_paths(gk)
                and jax.tree.structure(si) == jax.tree.structure(sk)
                and all(a.shape == b.shape and a.dtype == b.dtype
                        for a, b in zip(jax.tree.leaves(si), jax.tree.leaves(sk))))

    return next(p for p in range(1, len(layers) + 1) if all(alike(i, i % p) for i in range(len(layers))))


class ScannedLayers(nnx.Module):
    """A decoder's layers under decoder remat, called as one Tunix decoder layer is: its whole blocks as a scan
    over the blocks, the layers past them one by one, each layer in a ``jax.checkpoint`` keeping what ``remat``
    keeps (``step.remat.SAVED``).

    layers: the decoder's layers in order; period: the layers per block. Layer k of block j runs
    ``layer.block(x, segment_pos, None, attn_mask, **kwargs)`` on layer ``j * period + k``'s weights.
    """

    def __init__(self, layers: list[nnx.Module], period: int, remat: str = "decoder"):
        self.layers = nnx.List(layers)
        self.period = period
        self.remat = remat

    def __call__(self, x, segment_pos, cache, attn_mask, **kwargs):
        """x: [B, T, D] -> the output of the last layer, in the tuple a Tunix layer returns (no cache).

        Raises TrainingError given a KV cache: a scanned decoder trains, it does not generate."""
        if cache is not None:
            raise TrainingError("a scanned decoder (step.scan) runs without a KV cache; generate with the model "
                                "itself")
        p = self.period
        whole = len(self.layers) // p * p
        parts = [nnx.split(layer) for layer in self.layers]
        # states[k]: layer k of every block, each block's state an operand of the switch that chooses it
        states = [tuple(state for _, state in parts[k:whole:p]) for k in range(p)]
        policy = SAVED[self.remat]

        def layer(graphdef, x, state):
            return nnx.merge(graphdef, state).block(x, segment_pos, None, attn_mask, **kwargs)

        def layer_k(k, j, x, states_k):
            state = jax.lax.switch(j, [functools.partial(lambda i, s: s[i], i) for i in range(len(states_k))],
                                   states_k)
            return layer(parts[k][0], x, state)

        # What a layer returns: (cache, x) on Gemma 3, (cache, x, kv) on Gemma 4; and x's dtype, the carry's (a
        # layer widens a narrower input, as Gemma 4's float32 embedding in a float64 model: exactly, so first here).
        out = jax.eval_shape(functools.partial(layer, parts[0][0]), x, parts[0][1])
        x = x.astype(out[1].dtype)

        def block(x, j):
            for k in range(p):
                # In a scan the recomputation cannot be merged with the forward pass, so CSE may stay on.
                x = jax.checkpoint(functools.partial(layer_k, k), prevent_cse=False, policy=policy)(j, x,
                                                                                                    states[k])[1]
            return x, None

        x, _ = jax.lax.scan(block, x, jnp.arange(whole // p))
        for graphdef, state in parts[whole:]:
            x = jax.checkpoint(functools.partial(layer, graphdef), policy=policy)(x, state)[1]
        return (None, x) + (None,) * (len(out) - 2)  # no cache, no kv


def scanned_period(spec: GemmaSpec, lora_spec: LoraSpec | None, remat: str) -> int:
    """The layers per block `scanned_decoder` scans a model of ``spec`` with LoRA per ``lora_spec`` in, under
    Tunix's remat ``remat``; 0 where the decoder keeps its loop. Read from the spec, as the memory plan needs it
    (``tests/step/test_scan.py`` holds it to `scanned_decoder`'s choice on the models): the period of each layer's
    attention type, MLP width and LoRA factors' shapes.

    Example:
      >>> scanned_period(GemmaSpec.preset("gemma3-1b"), LoraSpec(rank=8), "decoder")
      6
    """
    if (remat not in SAVED or spec.per_layer_input_dim or spec.num_kv_shared_layers
            or (lora_spec is not None and lora_spec.alpha_pattern)):
        return 0
    factors = LoraLayout(spec, lora_spec).shapes() if lora_spec is not None else {}

    def layer(i):
        prefix = f"layers.{i}."
        return (spec.layer_types[i], spec.layer_mlp(i),
                sorted((name[len(prefix):], shape) for name, shape in factors.items() if name.startswith(prefix)))

    layers = [layer(i) for i in range(spec.num_layers)]
    p = next(p for p in range(1, len(layers) + 1) if all(layers[i] == layers[i % p] for i in range(len(layers))))
    return p if len(layers) // p >= MIN_BLOCKS or remat != "decoder" else 0


def scanned_decoder(model: nnx.Module) -> nnx.Module:
    """A copy of a Tunix Gemma 3 / Gemma 4 model whose decoder layers, under decoder remat
    (``step.remat.set_remat``: ``model.remat`` "decoder" or "projections"), run as `ScannedLayers`: a scan over the
    whole blocks of their pattern, then the layers past them. The same values and gradients; the program holds one
    block. ``model`` is not changed; the copy shares its arrays.

    The copy runs unrolled, as ``model`` does, under another remat (none, Tunix's block remat), and under
    "decoder" with per-layer inputs or KV sharing (Gemma 4 E2B/E4B: a layer reads another's keys and values), with
    PEFT's ``alpha_pattern`` (Qwix would match block 0's layer paths) or with fewer than ``MIN_BLOCKS`` blocks.

    Raises TrainingError under "projections" where the decoder cannot be scanned: only the scan keeps the
    projections' products.
    """
    copy = nnx.merge(*nnx.split(model))
    config = copy.config
    decoder = sys.modules[type(config).__module__].RematConfig.DECODER  # of the model's Tunix family
    if config.remat_config not in (decoder, decoder.value):
        return copy
    remat = getattr(copy, "remat", "decoder")
    shared = any(i != j for i, j in enumerate(getattr(copy, "kv_cache_sharing_patterns", ())))
    if shared or getattr(config, "per_layer_input_dim", 0) or getattr(
            getattr(copy, "lora_spec", None), "alpha_pattern", ()):
        if remat != "decoder":
            raise TrainingError(f"remat {remat!r} keeps the projections' products in a scanned decoder, and this "
                                "model's cannot be scanned (per-layer inputs, KV sharing or PEFT's alpha_pattern);"
                                " set gradient_checkpointing's remat to 'decoder'")
        return copy
    layers = list(copy.layers)
    p = decoder_period([nnx.split(layer) for layer in layers])
    if len(layers) // p < MIN_BLOCKS and remat == "decoder":
        return copy
    scanned = ScannedLayers(layers, p, remat)
    upstream.take_module_path(scanned, copy)  # the model's: what Qwix found here before the layers moved
    copy.layers = nnx.List([scanned])
    return copy


__all__ = ["MIN_BLOCKS", "ScannedLayers", "decoder_period", "scanned_decoder", "scanned_period"]
