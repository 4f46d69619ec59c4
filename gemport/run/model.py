"""The model a run trains, built from the architecture alone: a Tunix Gemma with Qwix LoRA and its remat policy,
shapes only (``nnx.eval_shape``: nothing allocated, no weight read) or with random weights.

``SFTRun.create(..., abstract=True)`` and ``gemport.plan`` build it so: the same graph as the loaded model
(``checkpoint.load_model`` + ``lora.apply_lora`` + ``step.remat.set_remat``), so a step compiled on it is the step
the run compiles (``tests/plan/test_one_step.py``).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
import qwix

from gemport.specs import names
from gemport._src.params import path_str
from gemport.checkpoint.quantize import how_to_quantize, set_quantized
from gemport.lora import LoraSpec, QLoraSpec, apply_lora
from gemport.lora.qlora import is_quantized
from gemport.specs import GemmaSpec
from gemport.step.remat import set_remat
from gemport._src import upstream


def quantize_base(model: nnx.Module, spec: GemmaSpec, qlora: QLoraSpec) -> None:
    """Make every projection weight of ``model`` (in place) the 4-bit base ``load_qlora_model`` places: a Qwix
    ``WithAux(QArray)`` of uint4 codes and float32 scales in bitsandbytes' blocks (``how_to_quantize``). The
    codes are Qwix's quantization of the weights the model holds; shapes, dtypes and shardings are the
    loader's, which is what a compile measures."""
    by_path = {e.tunix: e for e in names.entries(spec)}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        entry = by_path[path_str(path)]
        if not is_quantized(entry):
            continue
        how = how_to_quantize(entry, qlora)
        q = upstream.quantize_array(var.get_value(), how)
        set_quantized(model, path, qwix.QArray(q.qvalue, q.scale.astype(jnp.float32), qtype=q.qtype), how)


def lora_model(spec: GemmaSpec, lora_spec: LoraSpec, *, param_dtype=jnp.bfloat16, remat: str = "none",
               abstract: bool = True, qlora: QLoraSpec | None = None) -> nnx.Module:
    """A Tunix model of ``spec`` with Qwix LoRA per ``lora_spec`` and the remat ``remat`` (Tunix's
    ``remat_config`` "none", "block", "decoder", or "projections", ``step.remat.set_remat``): shapes only
    (``abstract``) or random; on a 4-bit base (``quantize_base``) with ``qlora``, its LoRA factors float32 as Qwix
    makes them there."""
    cfg = spec.to_tunix(param_dtype=param_dtype)

    def build():
        with nnx.var_defaults(ref=True):
            rngs = nnx.Rngs(0)
        model = spec.tunix_model_class()(cfg, rngs=rngs)
        if qlora is not None:
            quantize_base(model, spec, qlora)
        return apply_lora(model, spec, lora_spec, qlora=qlora)

    model = nnx.eval_shape(build) if abstract else build()
    set_remat(model, remat)
    return model


__all__ = ["lora_model", "quantize_base"]
