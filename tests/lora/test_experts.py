"""LoRA on Gemma 4's MoE experts as PEFT's ``target_parameters`` holds it (gemport.lora.experts): exports,
import, fresh adapters and refusals, against the real PEFT.

The MoE miniature with PEFT LoRA on both stacked expert parameters (``experts.gate_up_proj`` [E, 2I, D],
``experts.down_proj`` [E, D, I]), the router's ``proj.weight`` [E, D] and o_proj, every lora_B random.
Gradients and AdamW steps against PEFT are the ``gemma4_moe`` case of tests/lora/test_peft_training.py, which
targets the experts and the router too.
"""

import copy

import numpy as np
import peft
import pytest
import tiny
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file
from peft_training import EXPERTS, peft_model

from gemport.check import adapters
from gemport.checkpoint import export_merged, export_peft, import_peft, load_model
from gemport.errors import LoraError
from gemport.lora import PROJECTIONS, LoraLayout, LoraParams, LoraSpec, experts
from gemport.specs import GemmaSpec

# r = 8, a rank vLLM accepts; r > 1 tells PEFT's expert-major lora_A rows from its rank-major lora_B columns.
CONFIG = dict(r=8, lora_alpha=16, target_modules=["o_proj"], target_parameters=EXPERTS, lora_dropout=0.0)


def flat_lora(tree):
    return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(tree)}


@pytest.fixture(scope="module")
def case(hf_checkpoint, tmp_path_factory):
    """(PEFT model, HF checkpoint, spec, the PEFT adapter directory, its import: state and lora_spec), all fp32."""
    _, path = hf_checkpoint("gemma4_moe")
    model = peft_model(path, peft.LoraConfig(**CONFIG)).eval()
    adapter = tmp_path_factory.mktemp("experts-adapter")
    model.save_pretrained(adapter)
    spec = GemmaSpec.from_hf(path)
    return (model, path, spec, adapter, *import_peft(adapter, spec=spec))


def test_exports_and_import_are_peft_exact(case, tmp_path):
    """The import exported again is PEFT's file tensor for tensor, bit for bit, and PEFT loads it to the same
    logits; the merged export computes PEFT's logits within 10x PEFT's own merge_and_unload distance from them,
    and changes exactly the adapted weights."""
    model, path, spec, adapter, state, lora_spec = case
    out = export_peft(LoraParams(state, lora_spec), tmp_path / "peft", base_dir=path)
    original, written = load_file(adapter / "adapter_model.safetensors"), load_file(out / "adapter_model.safetensors")
    assert set(written) == set(original) and all(np.array_equal(written[k], original[k]) for k in original)
    assert peft.LoraConfig.from_pretrained(out).target_parameters == EXPERTS
    again = import_peft(out, base_dir=path)
    assert again.lora_spec == lora_spec
    flat, flat2 = LoraParams(state, lora_spec).flat(), again.flat()
    assert flat.keys() == flat2.keys() and all(np.array_equal(flat[k], flat2[k]) for k in flat)
    # gemport parity's adapter distances (each expert's delta, as PEFT's get_delta_weight), on the same adapter.
    distances = adapters.distances(adapters.port_deltas(state, spec, lora_spec), adapters.gpu_deltas(model))
    assert len(distances) == 4 * spec.num_layers and max(distances.values()) < 1e-6, distances
    ids = tiny.token_ids(spec.vocab)
    base = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    loaded = peft.PeftModel.from_pretrained(base, out).eval()
    want = tiny.hf_logits(model, ids)
    np.testing.assert_array_equal(tiny.hf_logits(loaded, ids), want)
    merged_dir = export_merged(LoraParams(state, lora_spec), tmp_path / "merged", base_dir=path)
    merged = tiny.hf_logits(transformers.AutoModelForCausalLM.from_pretrained(merged_dir,
                                                                               attn_implementation="eager"), ids)
    floor = np.abs(tiny.hf_logits(loaded.merge_and_unload(), ids) - want).max()
    assert 0 < floor and np.abs(merged - want).max() <= 10 * floor, (np.abs(merged - want).max(), floor)
    base_state = transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()
    changed = {k for k, v in transformers.AutoModelForCausalLM.from_pretrained(merged_dir).state_dict().items()
               if not torch.equal(v, base_state[k])}
    assert changed == {f"model.layers.{i}.{name}" for i in range(spec.num_layers)
                       for name in ("self_attn.o_proj.weight", *EXPERTS)}


def test_fresh_expert_adapters_start_and_count_as_peft(hf_checkpoint):
    """``LoraSpec.from_peft`` of the config: PEFT's trainable count; A in PEFT's kaiming-uniform range (fan-in
    the expert weight's input), B zero. PEFT's refusals (dropout) and what gemport does not carry are refused."""
    torch_model, path = hf_checkpoint("gemma4_moe")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(PROJECTIONS), target_parameters=EXPERTS)
    count, _ = peft.get_peft_model(copy.deepcopy(torch_model), config).get_nb_trainable_parameters()
    spec, lora_spec = GemmaSpec.from_hf(path), LoraSpec.from_peft(config)
    assert lora_spec.parameters == tuple(EXPERTS) and LoraLayout(spec, lora_spec).num_params == count
    # What apply_lora does after Qwix's own factors (whose dummy forward would compile the whole model here).
    model = load_model(path)
    experts.attach(model, LoraLayout(spec, lora_spec), seed=3)
    flat = flat_lora(nnx.state(model, nnx.LoRAParam))
    assert set(flat) == {n for a in LoraLayout(spec, lora_spec).experts for n in (a.lora_a, a.lora_b)}
    for adapter in LoraLayout(spec, lora_spec).experts:
        a, b = flat[adapter.lora_a], flat[adapter.lora_b]
        bound = 1 / np.sqrt(adapter.peft_shapes[0][1])
        assert not b.any() and np.abs(a).max() <= bound and np.abs(a).max() > 0.8 * bound
    with pytest.raises(LoraError, match="lora_dropout"):
        LoraSpec.from_peft(config.to_dict() | {"lora_dropout": 0.05})
    for target, why in (("proj.weight", "MoE only"), ("layers.0.experts.down_proj", "layer subset"),
                        ("router.scale", "MoE only")):
        with pytest.raises(LoraError, match=why):
            LoraSpec.from_peft(config.to_dict() | {"target_parameters": [target]})
