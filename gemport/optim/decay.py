"""HF's weight-decay exclusions as a mask over parameter paths.

HF's Trainer decays every trainable parameter except those whose lower-cased dotted name matches
one of a few patterns (biases and norm weights). The same patterns pick out exactly the norm
scales in Tunix's Gemma paths (``layers.0.pre_attention_norm.scale``, ``final_norm.scale``,
``layers.0.attn._query_norm.scale``) and leave Qwix LoRA factors (``...q_einsum.w_lora_a``)
decayed, as HF decays PEFT's ``lora_A``/``lora_B``.

Gemma 4 has one parameter whose status differs between the frameworks: HF registers each
layer's ``layer_scalar`` as a buffer, so HF never trains or decays it, while Tunix makes the same
value a trainable ``skip_scale`` Param. It is excluded here, as HF's decay set does not contain it.
"""

import re

import jax
import optax

_NO_DECAY = re.compile(
    "|".join(
        [
            r"bias",
            r"layernorm",
            r"rmsnorm",
            r"(?:^|\.)norm(?:$|\.)",
            r"_norm(?:$|\.)",
            r"(?:^|\.)skip_scale(?:$|\.)",
        ]
    )
)


def decays(name: str) -> bool:
    """Whether HF's Trainer applies weight decay to the parameter called ``name``.

    Maps ``Trainer.get_decay_parameter_names``: ``name`` is a dotted path (an HF parameter name,
    a Tunix/nnx state path, or a LoRA factor's path); it is excluded from decay iff its lower-cased
    form contains ``bias``, ``layernorm`` or ``rmsnorm``, has a component ``norm``, or a component
    ending in ``_norm``; plus Tunix's ``skip_scale`` (HF's ``layer_scalar`` buffer). HF also
    excludes parameters of ``torch.nn.LayerNorm`` modules by type; Gemma 4's only such module is
    named ``norm``, so the names suffice.
    """
    return _NO_DECAY.search(name.lower()) is None


def decay_mask(params: optax.Params) -> optax.Params:
    """A pytree of bools, shaped like ``params``: True where HF would apply weight decay.

    Each leaf is judged by ``decays`` on its key path joined with dots (``layers.0.attn.q_einsum.w``
    for an nnx state, the key itself for a flat dict keyed by HF names). Pass it, or this function
    itself, as the ``mask`` of ``optax.adamw`` / ``optax.add_decayed_weights``.
    """
    return jax.tree_util.tree_map_with_path(
        lambda path, _: decays(jax.tree_util.keystr(path, simple=True, separator=".")), params
    )
