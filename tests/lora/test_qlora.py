"""QLoRA: bitsandbytes 4-bit NF4 bases (transformers + PEFT + TRL, run here on CPU) against Qwix NF4 on Tunix."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf
from flax import nnx

from gemport.specs import names
from gemport.checkpoint.quantize import load_qlora_model, nf4, nf4_values, to_qarray
from gemport.lora.qlora import tile_shape
from gemport.errors import LoraError
from gemport.lora import LoraSpec, QLoraSpec, apply_lora
from gemport.specs import GemmaSpec
from quantized import dequantized
from tiny import hf_logits, token_ids
from lora_targets import TARGETS
from qlora_configs import QLORA_CONFIGS

bnb_f = pytest.importorskip("bitsandbytes.functional")

NF4 = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype="float32")


def bnb_model(path, double_quant):
    """transformers + bitsandbytes' 4-bit model of ``path``, in train mode: bitsandbytes' CPU inference kernel
    (eval mode) computes in bfloat16 with bfloat16 scales, which no GPU recipe runs; training dequantizes in the
    compute dtype and multiplies, as on a GPU."""
    model = tf.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager",
        quantization_config=tf.BitsAndBytesConfig(**NF4, bnb_4bit_use_double_quant=double_quant))
    return model.train()


def bnb_weights(model):
    """{HF weight name relative to the text prefix: bitsandbytes' dequantized float32 array}, of a model or of
    a PEFT model on it."""
    import bitsandbytes as bnb

    return {name[name.index("layers."):].removesuffix(".base_layer") + ".weight":
            bnb_f.dequantize_4bit(m.weight.data, m.weight.quant_state).numpy()
            for name, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}


# The config maps ------------------------------------------------------------------------------------------------


def test_bitsandbytes_config_its_dict_and_trl_fields_map_to_the_same_base(tmp_path):
    expected = QLoraSpec(double_quant=True, compute_dtype="bfloat16")
    bnb = tf.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)
    assert QLoraSpec.from_config(bnb) == expected
    assert QLoraSpec.from_config(bnb.to_dict()) == expected
    # TRL's ModelConfig (and so a `trl sft --config` YAML): the compute dtype is the model's dtype.
    from trl import ModelConfig

    trl = ModelConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", use_bnb_nested_quant=True, dtype="bfloat16")
    assert QLoraSpec.from_config(trl) == expected
    assert QLoraSpec.from_config({"load_in_4bit": True, "use_bnb_nested_quant": True, "dtype": "bfloat16"}) == expected
    (tmp_path / "config.json").write_text(tf.Gemma3TextConfig(quantization_config=bnb.to_dict()).to_json_string())
    assert QLoraSpec.from_config(tmp_path) == expected
    (tmp_path / "recipe.yaml").write_text("load_in_4bit: true\nuse_bnb_nested_quant: true\ndtype: bfloat16\n")
    from gemport import recipe

    assert recipe.read(tmp_path / "recipe.yaml").qlora() == expected  # a recipe has one reader
    with pytest.raises(LoraError, match=r"gemport.recipe.read\(.*\).qlora\(\)"):
        QLoraSpec.from_config(tmp_path / "recipe.yaml")
    from gemport.check.parity import read_recipe

    with pytest.raises(LoraError, match=r"recipe.yaml: the recipe loads its base in 4 bits .*trajectory"):
        read_recipe(tmp_path / "recipe.yaml")
    assert QLoraSpec.from_config({"load_in_4bit": False}) is None
    assert QLoraSpec.from_config(ModelConfig()) is None
    assert QLoraSpec.from_config(tf.BitsAndBytesConfig(**QLoraSpec(compute_dtype="float32").to_bnb())) == QLoraSpec(
        compute_dtype="float32")


@pytest.mark.parametrize("fields, match", [
    ({"load_in_8bit": True}, "load_in_8bit=True: LLM.int8"),
    ({"load_in_4bit": True, "bnb_4bit_quant_type": "fp4"}, "bnb_4bit_quant_type='fp4'"),
    ({"load_in_4bit": True, "llm_int8_skip_modules": ["lm_head", "mlp.down_proj"]}, r"keeps \['down_proj'\]"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method='gptq'"),
    ({"load_in_4bit": True, "llm_int8_enable_fp32_cpu_offload": True}, "offload"),
    ({"load_in_4bit": True, "bnb_4bit_compute_dtype": "int8"}, "compute dtype 'int8'"),
    ({"load_in_4bit": "yes"}, "load_in_4bit='yes' is not true or false"),
], ids=["int8", "fp4", "skip-projection", "gptq", "offload", "compute-dtype", "not-bool"])
def test_what_cannot_be_reproduced_is_refused_naming_the_field(fields, match):
    with pytest.raises(LoraError, match=match):
        QLoraSpec.from_config(fields)


# The quantizer against bitsandbytes' -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nf4_codes_and_absmax_are_bitsandbytes(dtype):
    """gemport's NF4 of a weight dequantizes to bitsandbytes' exactly, with and without double quantization;
    double quantization itself moves the weights by about 0.3% of their largest value (measured here)."""
    assert np.array_equal(nf4_values(), bnb_f.get_4bit_type("nf4", device="cpu").numpy())
    w = torch.randn(256, 192, generator=torch.Generator().manual_seed(0)).mul(0.05).to(dtype)
    w[3, :64] = 0.0  # an all-zero block
    for double_quant in (False, True):
        q, state = bnb_f.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=double_quant)
        expected = bnb_f.dequantize_4bit(q, state).float().numpy()
        entry = names.Entry("w", ("w",), "f d -> d f", (("d", 192), ("f", 256)))
        mine = to_qarray(entry, [w.float().numpy()], QLoraSpec(double_quant=double_quant))
        got = (nf4_values()[np.asarray(mine.qvalue, np.uint8)] * np.repeat(mine.scale, 64, axis=0)).T
        got = torch.from_numpy(got).to(dtype).float().numpy()
        assert np.array_equal(got, expected), np.abs(got - expected).max()
    plain = bnb_f.dequantize_4bit(*bnb_f.quantize_4bit(w, blocksize=64, quant_type="nf4")).float()
    shift = float((plain - torch.from_numpy(expected)).abs().max() / plain.abs().max())
    print(f"double quantization moves {dtype} weights by {shift:.2e} of their max |w|")
    assert 1e-4 < shift < 1e-2


def test_nf4_ties_round_to_the_lower_value():
    values = nf4_values()
    midpoints = (values[1:] + values[:-1]) / 2
    codes, absmax = nf4(np.concatenate([midpoints, [1.0] * (64 - 15)]), 64)
    assert absmax[0] == 1.0 and list(codes[:15]) == list(range(15))


def test_blocks_follow_the_hf_input_dimension_into_tunix_axes():
    spec = GemmaSpec.from_hf(QLORA_CONFIGS["gemma4"].to_dict())
    tiles = {e.tunix: tile_shape(e, 64) for e in names.entries(spec) if e.tunix.startswith("layers.")
             and e.tunix.endswith((".w", ".kernel"))}
    assert tiles["layers.0.attn.attn_vec_einsum.w"] == (2, 32, 1)  # two 32-wide heads per block
    assert tiles["layers.1.attn.attn_vec_einsum.w"] == (1, 64, 1)  # a 64-wide global head per block
    assert tiles["layers.1.attn.k_einsum.w"] == (1, 64, 1)
    assert tiles["layers.0.mlp.down_proj.kernel"] == (64, 1)
    narrow = GemmaSpec.from_hf(dataclasses.replace(spec, hidden=40).to_hf_config())
    (q,) = [e for e in names.entries(narrow) if e.tunix == "layers.0.attn.q_einsum.w"]
    with pytest.raises(LoraError, match=r"layers.0.self_attn.q_proj.weight: input dimension \(d=40\)"):
        tile_shape(q, 64)


# The loaded base and the forward pass ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gemma3", "gemma4"])
@pytest.mark.parametrize("double_quant", [False, True], ids=["plain", "double-quant"])
def test_loaded_base_is_bitsandbytes_dequantized_weights(qlora_base, name, double_quant):
    path = qlora_base(name)
    expected = bnb_weights(bnb_model(path, double_quant))
    model = load_qlora_model(path, QLoraSpec(double_quant=double_quant))
    got = dequantized(model)
    spec = GemmaSpec.from_hf(path)
    entries = [e for e in names.entries(spec) if e.tunix in got]
    assert {h for e in entries for h in e.hf} == set(expected)
    for e in entries:
        assert np.array_equal(got[e.tunix], e.to_tunix([expected[h] for h in e.hf])), e.tunix
    assert model.layers[0].attn.attn_vec_einsum.w.array.qvalue.dtype == jnp.uint4


def peft_adapter(model, out_dir, seed=1):
    """PEFT LoRA on every projection of ``model`` with random non-zero B, saved to ``out_dir``."""
    import peft

    peft_model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    peft_model.save_pretrained(out_dir)
    return peft_model


def tunix_logits(model, ids):
    """float32 logits of a Tunix model on ``ids``, jitted: one compile instead of one per eager op."""
    b, t = ids.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    forward = nnx.jit(lambda m, x: m(x, positions, None, jnp.tril(jnp.ones((b, t, t), bool)))[0])
    return np.asarray(forward(model, jnp.asarray(ids)), np.float32)


@pytest.fixture(scope="module")
def qlora_port(qlora_base, tmp_path_factory):
    """The two-layer Gemma 4 (k_eq_v global layer: every tile form of
    `test_blocks_follow_the_hf_input_dimension_into_tunix_axes`) on its double-quantized 4-bit base, with a
    PEFT adapter of random non-zero B: (base dir, adapter dir, PEFT on transformers + bitsandbytes, the port)."""
    from gemport.checkpoint import import_peft

    path, adapter = qlora_base("gemma4"), tmp_path_factory.mktemp("qlora-adapter")
    qlora = QLoraSpec(double_quant=True)
    gpu = peft_adapter(bnb_model(path, True), adapter)
    lora = import_peft(adapter, base_dir=path)
    port = apply_lora(load_qlora_model(path, qlora), GemmaSpec.from_hf(path), lora, qlora=qlora)
    return path, adapter, gpu, port


def test_qlora_logits_match_transformers_bitsandbytes_and_peft(qlora_port, tmp_path):
    """The port's QLoRA model (4-bit base + imported adapter) gives PEFT-on-bitsandbytes' logits as closely as
    the unquantized port gives float32 PEFT's on the same (dequantized) weights: the float32 noise floor of
    this very function, measured here. A port that left out double quantization would be caught."""
    import peft

    from gemport.checkpoint import import_peft, load_model

    path, adapter, gpu, port = qlora_port
    ids = token_ids(96)
    diff = np.abs(tunix_logits(port, ids) - hf_logits(gpu, ids)).max()

    weights = bnb_weights(gpu)
    plain = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for name, p in plain.model.named_parameters():
            if name in weights:
                p.copy_(torch.from_numpy(weights[name]))
    plain.save_pretrained(tmp_path / "dequantized")
    plain_gpu = peft.PeftModel.from_pretrained(plain, adapter)
    spec = GemmaSpec.from_hf(path)
    plain_port = apply_lora(load_model(tmp_path / "dequantized", spec=spec), spec, import_peft(adapter, base_dir=path))
    floor = np.abs(tunix_logits(plain_port, ids) - hf_logits(plain_gpu, ids)).max()
    tolerance = 4 * floor
    print(f"QLoRA logits differ by {diff:.2e}; the unquantized port on the dequantized weights by {floor:.2e}")
    assert diff <= tolerance

    # The bound is tight enough to catch a base that differs by as little as double quantization changes it.
    unnested = peft.PeftModel.from_pretrained(bnb_model(path, False), adapter).train()
    assert np.abs(hf_logits(unnested, ids) - hf_logits(gpu, ids)).max() > 100 * tolerance


def test_loading_holds_one_tensor_at_a_time_on_the_host(qlora_base):
    """Host (NumPy) allocations while loading, beyond the loaded model itself (on CPU the devices' memory is
    the host's), peak at a few copies of the largest tensor: not the model's size."""
    import tracemalloc

    path = qlora_base("wide")
    spec = GemmaSpec.from_hf(path)
    sizes = [np.prod(e.hf_shape) * len(e.hf) * 4 for e in names.entries(spec) if e.hf]
    tracemalloc.start()
    model = load_qlora_model(path, QLoraSpec())
    resident, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"host transient peak {peak - resident} B, largest tensor {max(sizes)} B, model {sum(sizes)} B")
    assert peak - resident < 8 * max(sizes) < sum(sizes)
    assert model.layers[2].mlp.down_proj.kernel.array.scale.shape == (8, 128)


def test_sharded_qlora_base_places_codes_and_scales_on_the_mesh(qlora_base):
    from gemport.mesh import make_mesh

    path = qlora_base("gemma3")
    mesh = make_mesh(GemmaSpec.from_hf(path), fsdp=4, tp=2)
    sharded = load_qlora_model(path, QLoraSpec(), mesh=mesh)
    w = sharded.layers[0].mlp.down_proj.kernel.array
    assert w.qvalue.sharding.mesh.shape == {"fsdp": 4, "tp": 2}
    assert len({str(s.index) for s in w.qvalue.addressable_shards}) > 1 and w.scale.sharding.mesh is mesh
    single = dequantized(load_qlora_model(path, QLoraSpec()))
    on_mesh = dequantized(sharded)
    assert on_mesh.keys() == single.keys()
    for key in single:
        assert np.array_equal(on_mesh[key], single[key]), key


def test_memory_plan_counts_the_4bit_base_as_loaded(qlora_base):
    """The plan's base bytes per device equal what the loaded 4-bit base holds on device 0 (uint4 codes at 4
    bits, float32 scales, the rest float32), on a 4 x 2 mesh; and the 4-bit base is 4.5/32 of float32's there."""
    from gemport.mesh import make_mesh
    from gemport.plan import memory_plan

    path = qlora_base("gemma3")
    spec = GemmaSpec.from_hf(path)
    model = load_qlora_model(path, QLoraSpec(), mesh=make_mesh(spec, fsdp=4, tp=2))
    held = 0
    for _, leaf in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        shard = leaf.get_value().addressable_shards[0].data
        held += shard.size * jnp.dtype(shard.dtype).itemsize if shard.dtype != jnp.uint4 else shard.size // 2
    plan = memory_plan(spec, 4, 2, lora_spec=LoraSpec(4, 8.0), param_dtype="float32", qlora=QLoraSpec())
    assert plan.base_bytes == held
    full = memory_plan(spec, 4, 2, lora_spec=LoraSpec(4, 8.0), param_dtype="float32")
    assert plan.lora_bytes == full.lora_bytes and plan.base_bytes < full.base_bytes


def test_qlora_trajectory_agrees_with_trl_on_the_4bit_base(qlora_base):
    """TRL's SFTTrainer + PEFT on bitsandbytes' double-quantized NF4 base vs the port on its Qwix NF4 base:
    4 steps with accumulation 2, clipping, weight decay and a warmup + cosine schedule, on the two-layer
    Gemma 4 (a k_eq_v global layer), float32 adapters on both sides (TRL's bfloat16 cast undone, see
    `gemport.check.parity.trajectory`). The tolerance is the unquantized trajectory's float32 one plus what the two
    bases differ by, measured here: nothing (the bases are equal)."""
    from gemport.check.parity import Tolerances, trajectory
    from sft_recipe import RECIPE
    from chats import chats, tokenizer

    path = qlora_base("gemma4")
    qlora = QLoraSpec.from_config({"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "use_bnb_nested_quant": True,
                                   "dtype": "float32"})
    expected = bnb_weights(bnb_model(path, qlora.double_quant))
    got = dequantized(load_qlora_model(path, qlora))
    entries = [e for e in names.entries(GemmaSpec.from_hf(path)) if e.tunix in got]
    base_gap = max(np.abs(got[e.tunix] - e.to_tunix([expected[h] for h in e.hf])).max() for e in entries)
    assert base_gap == 0.0
    # Gradient checkpointing (TRL's default) recomputes the same float32 forward: off, for time.
    sft = {k: v for k, v in RECIPE.items() if not k.startswith("lora_")} | {"max_steps": 4,
                                                                          "gradient_checkpointing": False}
    report = trajectory(path, chats(8), sft_config=sft, tokenizer=tokenizer(), progress=False, qlora=qlora,
                        lora_config={"r": 4, "lora_alpha": 8, "target_modules": TARGETS}, tolerances=Tolerances())
    print(report.table())
    assert len(report.rows) == 4 and report.ok, report.table()
    assert len(report.adapters) == 2 * 7 - 1  # the k_eq_v global layer has no v_proj


def test_qlora_dpo_trajectory_agrees_with_trl_on_the_4bit_base(qlora_base, tmp_path):
    """DPO on a 4-bit base: TRL's DPOTrainer + PEFT on bitsandbytes' double-quantized NF4 base (its reference the
    base with the adapter disabled) against `gemport dpo`'s step on the Qwix NF4 base that `DPORun.create` loads
    from a recipe's load_in_4bit fields (bitwise load_qlora_model's), 3 steps with accumulation 2 and clipping:
    loss, grad_norm, TRL's DPO metrics and the final adapter within 10 x the floor measured in the run."""
    import jax
    import yaml

    from gemport import recipe
    from gemport.run import DPORun
    from gemport.check.dpo_parity import trajectory
    from gemport.mesh import make_mesh
    from preference_records import RECORDS
    from chats import tokenizer

    path = qlora_base("gemma4")
    records = RECORDS["conversational"][:3]
    fields = dict(per_device_train_batch_size=1, gradient_accumulation_steps=2, max_steps=3, learning_rate=5e-3,
                  max_grad_norm=0.05, beta=0.5, seed=3, bf16=False, gradient_checkpointing=False)
    qlora_fields = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", use_bnb_nested_quant=True, dtype="float32")
    config = tmp_path / "dpo.yaml"
    config.write_text(yaml.safe_dump({**fields, **qlora_fields, "use_peft": True, "lora_r": 4, "lora_alpha": 8,
                                      "lora_target_modules": TARGETS}))
    qlora = recipe.read(config, command="dpo").qlora()
    assert qlora == QLoraSpec(double_quant=True, compute_dtype="float32")
    run = DPORun.create(config, path, records, tokenizer=tokenizer(), progress=False,
                        mesh=make_mesh(GemmaSpec.from_hf(path), fsdp=1, tp=1, devices=jax.devices()[:1]))
    got, want = dequantized(run.model), dequantized(load_qlora_model(path, qlora))
    assert got.keys() == want.keys() and len(want) > 0
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)

    report = trajectory(path, records, dpo_config=fields, tokenizer=tokenizer(), progress=False, qlora=qlora,
                        lora_config={"r": 4, "lora_alpha": 8, "target_modules": TARGETS, "lora_dropout": 0.0})
    print(report.table())
    assert len(report.rows) == 3 and report.ok, report.table()
    assert report.floor_name == "TRL eager vs sdpa attention, float32"
    assert min(r.grad_norm_gpu for r in report.rows) > fields["max_grad_norm"]  # clipping is in play
    assert any(m.gpu != 0 for m in report.metrics if m.name == "rewards/margins")  # the adapter moved


def test_exports_of_a_qlora_adapter_are_plain_lora_and_merge_onto_the_unquantized_base(qlora_port, tmp_path):
    """The PEFT export of a QLoRA model is its adapter, bit for bit (with vLLM's v_proj copies); the merged export is PEFT's
    ``merge_and_unload`` onto the unquantized base (not the 4-bit one it trained on): the logits it serves
    differ from the QLoRA model's by the quantization error, measured here."""
    import peft

    from gemport.checkpoint import HFCheckpoint, export_merged, export_peft, import_peft
    from gemport.checkpoint.safetensors import SafetensorsFile
    from gemport.lora import LoraParams

    path, adapter, gpu, port = qlora_port
    trained = LoraParams(nnx.state(port, nnx.LoRAParam), import_peft(adapter, base_dir=path).lora_spec)
    with pytest.warns(UserWarning, match="max_lora_rank"):
        export_peft(trained, tmp_path / "peft", base_dir=path)
    given, written = (SafetensorsFile(d / "adapter_model.safetensors") for d in (adapter, tmp_path / "peft"))
    # Beyond the adapter: k_proj's factors again as v_proj on k_eq_v layers, for vLLM (docs: Serving on vLLM).
    copies = {key.replace(".k_proj.", ".v_proj."): key for key in given.tensors
              if ".k_proj." in key and key.replace(".k_proj.", ".v_proj.") not in given.tensors}
    assert copies and set(written.tensors) == set(given.tensors) | set(copies)
    for key in given.tensors:
        assert np.array_equal(given.array(key), written.array(key)), key
    for copy, key in copies.items():
        assert np.array_equal(given.array(key), written.array(copy)), copy

    export_merged(trained, tmp_path / "merged", base_dir=path)
    plain = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    merged = peft.PeftModel.from_pretrained(plain, tmp_path / "peft").merge_and_unload().state_dict()
    ours = HFCheckpoint(tmp_path / "merged")
    for name in ours.keys():
        np.testing.assert_allclose(ours.array(name), merged[name].numpy(), atol=1e-6, rtol=0, err_msg=name)
    served = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32,
                                                     attn_implementation="eager")
    ids = token_ids(96)
    gap = np.abs(hf_logits(served, ids) - hf_logits(gpu, ids)).max()
    print(f"merged onto the unquantized base: logits move by {gap:.3e} from the QLoRA model's")
    assert gap > 1e-3
