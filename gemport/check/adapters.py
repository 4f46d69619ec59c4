"""The final adapters of a comparison, as one measure: each module's s*B@A in PEFT's layout, and how far apart.

A comparison (``check.parity``, ``check.dpo_parity``) judges the adapters both sides end with by each HF module's
delta s*B@A: the GPU side's from its PEFT model (``gpu_deltas``), the port's from its Tunix model with LoRA, laid
out as PEFT's (``port_deltas``), their distance the max-abs difference over the GPU delta's max-abs
(``distances``).
"""

import numpy as np
from flax import nnx

from gemport._src.params import flat_params
from gemport.lora import LoraLayout


def adapter_distances(trained, peft_model, spec=None, lora_spec=None):
    """{module: how far ``trained``'s final s*B@A ends from ``peft_model``'s}: max-abs difference over the PEFT
    delta's max-abs, per module (``Trajectory.adapters``). trained: a PEFT model, or the port's Tunix model with
    LoRA, laid out as PEFT's by ``spec`` (``GemmaSpec``) and ``lora_spec``."""
    got = gpu_deltas(trained) if spec is None else port_deltas(trained, spec, lora_spec)
    return distances(got, gpu_deltas(peft_model))


def gpu_deltas(peft_model):
    """{HF module: s*B@A} of a PEFT model, float64."""
    from peft.tuners.lora import LoraLayer, ParamWrapper  # optional: the hf extra

    params = {k: v.detach().double().numpy() for k, v in peft_model.named_parameters() if "lora_" in k}
    scales = {k: v.scaling["default"] for k, v in peft_model.named_modules() if isinstance(v, LoraLayer)}
    out = {}
    for key, a in params.items():
        if key.endswith(".lora_A.default.weight"):
            name = key[: -len(".lora_A.default.weight")]
            out[name] = params[name + ".lora_B.default.weight"] @ a * scales[name]
    for name, module in peft_model.named_modules():
        if isinstance(module, ParamWrapper):  # target_parameters: one delta per expert, [E, out, in]
            out[name] = module.get_delta_weight("default").detach().double().numpy()
    return out


def port_deltas(port, spec, lora_spec):
    """{HF module: s*B@A} of the port's LoRA factors (its Tunix model, or that model's state), in PEFT's layout,
    float64."""
    params = {k: np.asarray(v, np.float64) for k, v in flat_params(port, nnx.LoRAParam).items()}
    out = {}
    layout = LoraLayout(spec, lora_spec)
    for adapter, a, b in layout.match(params, source="port"):
        for module, (A, B), scale in zip(adapter.hf_modules, adapter.to_peft(a, b), adapter.peft_scales):
            out[module] = B @ A * scale
    for adapter, a, b in layout.match_experts(params):
        out[adapter.peft_key(lora_spec.parameters)] = adapter.delta(a, b).astype(np.float64)
    return out


def distances(got, gpu, want=None):
    """{module: max |got - want| / max |gpu|} over ``got``'s modules (``want``: ``gpu`` unless given, keyed as
    ``got``); ``gpu`` is keyed by PEFT's module names, which end with the port's."""
    out = {}
    for module, delta in got.items():
        (key,) = [k for k in gpu if k == module or k.endswith(f".{module}")]
        reference = gpu[key] if want is None else want[module]
        out[module] = float(np.abs(delta - reference).max() / max(np.abs(gpu[key]).max(), 1e-30))
    return out


__all__ = ["adapter_distances", "distances", "gpu_deltas", "port_deltas"]
