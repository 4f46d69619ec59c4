"""Mesh factories and memory plans for the published Gemma sizes, on 8 simulated CPU devices."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from gemport.specs import names
from gemport.lora import LoraSpec
from gemport.mesh import MeshError, make_mesh, sharded_dims, valid_tp
from gemport.plan import HBM, memory_plan, valid_meshes
from gemport.specs import GemmaSpec

G31 = GemmaSpec.preset("gemma4-31b")

# Valid tp on 8 devices and, for the first tp that fails, the dimension that stops it.
VALID_TP = {
    "gemma3-1b": ([1, 2, 4], "query heads = 4 in every layer"),
    "gemma3-4b": ([1, 2, 4], "KV heads = 4 in every layer"),
    "gemma3-12b": ([1, 2, 4, 8], None),
    "gemma3-27b": ([1, 2, 4, 8], None),
    "gemma4-e2b": ([1, 2, 4, 8], None),  # 1 KV head: Tunix leaves it unsharded
    "gemma4-e4b": ([1, 2], "KV heads = 2 in every layer"),
    "gemma4-31b": ([1, 2, 4], "KV heads = 4 in the global layers 5, 11, 17"),
    "gemma4-26b-a4b": ([1, 2], "KV heads = 2 in the global layers 5, 11, 17"),
}


def test_31b_tp8_names_the_global_kv_heads():
    with pytest.raises(MeshError) as err:
        make_mesh(G31, tp=8)
    text = str(err.value)
    assert "tp=8 does not divide KV heads = 4 in the global layers 5, 11, 17, 23, 29, 35, ..., 59" in text
    assert "layers.5.attn.k_einsum.w" in text
    assert "valid tp on 8 devices: [1, 2, 4]" in text
    # Only the global KV heads fail: 32 query heads, 16 sliding KV heads, widths and vocabulary divide by 8.
    assert text.count("does not divide") == 1


def test_31b_tp4_is_an_auto_mesh_that_with_sharding_constraint_accepts():
    mesh = make_mesh(G31, tp=4)
    assert dict(mesh.shape) == {"fsdp": 2, "tp": 4}
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    sharding = NamedSharding(mesh, PartitionSpec("fsdp", "tp"))
    with jax.set_mesh(mesh):
        out = jax.jit(lambda x: jax.lax.with_sharding_constraint(x * 2, sharding))(jnp.ones((4, 8)))
    assert out.sharding.is_equivalent_to(sharding, 2)


@pytest.mark.parametrize("name", sorted(VALID_TP))
def test_valid_tp_of_presets(name):
    spec = GemmaSpec.preset(name)
    valid, culprit = VALID_TP[name]
    assert valid_tp(spec, 8) == valid
    assert [(p.fsdp, p.tp) for p in valid_meshes(spec, 8)] == [(8 // t, t) for t in valid]
    assert dict(make_mesh(spec).shape) == {"fsdp": 8 // valid[-1], "tp": valid[-1]}
    if culprit:
        with pytest.raises(MeshError, match=culprit):
            make_mesh(spec, tp=valid[-1] * 2, fsdp=8 // (valid[-1] * 2))


def test_sizes_are_completed_and_checked():
    assert dict(make_mesh(G31, fsdp=8).shape) == {"fsdp": 8, "tp": 1}
    assert dict(make_mesh(G31, tp=2).shape) == {"fsdp": 4, "tp": 2}
    assert dict(make_mesh(G31, tp=4, devices=jax.devices()[:4]).shape) == {"fsdp": 1, "tp": 4}
    with pytest.raises(MeshError, match="fsdp=2 x tp=2 = 4 devices, but 8 are given"):
        make_mesh(G31, fsdp=2, tp=2)


def test_fsdp_misfit_names_the_model_width():
    spec = dataclasses.replace(GemmaSpec.preset("gemma3-1b"), hidden=1156)
    with pytest.raises(MeshError) as err:
        make_mesh(spec, fsdp=8, tp=1)
    assert "fsdp=8 does not divide model width = 1156 in every layer" in str(err.value)
    assert "embedder.input_embedding" in str(err.value)


def test_sharded_dims_come_from_tunix_annotations():
    dims = {(d.axis, d.dim, d.size, d.where.split(" 5,")[0]) for d in sharded_dims(G31)}
    assert dims == {
        ("tp", "query heads", 32, "every layer"),
        ("tp", "KV heads", 16, "the sliding layers 0, 1, 2, 3, 4, 6, ..., 58"),
        ("tp", "KV heads", 4, "the global layers"),
        ("tp", "head width", 256, "the sliding layers 0, 1, 2, 3, 4, 6, ..., 58"),
        ("tp", "head width", 512, "the global layers"),
        ("tp", "model width", 5376, "every layer"),
        ("tp", "MLP width", 21504, "every layer"),
        ("tp", "vocabulary", 262144, "embedder.input_embedding"),
        ("fsdp", "model width", 5376, "every layer"),
    }


def test_experts_are_sharded_checked_and_counted():
    """26B-A4B: fsdp shards the expert stacks' expert axis and tp their widths (Tunix's annotations), a mesh whose
    fsdp does not divide the experts is refused naming them, and the plan's base holds every expert."""
    moe = GemmaSpec.preset("gemma4-26b-a4b")
    dims = {(d.axis, d.dim, d.size, d.where) for d in sharded_dims(moe)}
    assert {("fsdp", "experts", 128, "every layer"), ("tp", "expert width", 704, "every layer")} <= dims
    with pytest.raises(MeshError, match=r"fsdp=4 does not divide experts = 6 in every layer \(layers.0.moe"):
        make_mesh(dataclasses.replace(moe, num_experts=6), fsdp=4, tp=2)
    experts = moe.num_layers * moe.num_experts * 3 * moe.expert_dim * moe.hidden  # gate, up and down per expert
    assert experts == sum(math.prod(e.tunix_shape) for e in names.entries(moe) if ".moe." in e.tunix
                          and e.tunix.endswith(("gating_einsum", "linear")))
    plan = memory_plan(moe, 1, 1, lora_spec=LoraSpec(16, 32.0), hbm_bytes="v5p")
    assert plan.base_bytes == 2 * sum(math.prod(e.tunix_shape) for e in names.entries(moe)) > 2 * experts


def _lora_elements(spec: GemmaSpec, rank: int) -> int:
    """r * (in + out) per HF projection (PEFT's count), straight from the architecture."""
    total = 0
    for i in range(spec.num_layers):
        d, n, h, k, f = spec.hidden, spec.num_heads, spec.layer_head_dim(i), spec.layer_kv_heads(i), spec.layer_mlp(i)
        kv = (d + k * h) * (1 if spec.layer_k_eq_v(i) else 2)
        total += rank * ((d + n * h) + kv + (n * h + d) + 3 * (d + f))
    return total


def test_31b_plan_on_one_device_counts_every_param_and_lora_factor():
    plan = memory_plan(G31, 1, 1, lora_spec=LoraSpec(16, 32.0), hbm_bytes="v6e")
    params = sum(math.prod(e.tunix_shape) for e in names.entries(G31))
    assert params == 30_697_345_340
    assert plan.base_bytes == 2 * params
    assert plan.lora_bytes == 4 * _lora_elements(G31, 16)  # float32 factors on the bfloat16 base, as PEFT's
    assert plan.optimizer_bytes == 2 * plan.lora_bytes
    assert plan.fits is False  # 57.2 GiB of bf16 weights on a 32 GiB v6e chip
    assert memory_plan(G31, 1, 1, lora_spec=LoraSpec(16, 32.0), moments_dtype="bfloat16").optimizer_bytes == plan.lora_bytes
    full = memory_plan(G31, 1, 1)
    assert full.lora_bytes == 0 and full.optimizer_bytes == 2 * full.base_bytes


def test_31b_lora_fits_a_v5p_8_at_every_valid_tp():
    plans = valid_meshes(G31, 4, hbm_bytes="v5p", lora_spec=LoraSpec(16, 32.0), batch=4, seq_len=1024, remat="decoder")
    assert [(p.tp, p.fits) for p in plans] == [(1, True), (2, True), (4, True)]
    # Without a batch the plan does not claim the step fits.
    assert [p.fits for p in valid_meshes(G31, 4, hbm_bytes="v5p", lora_spec=LoraSpec(16, 32.0))] == [None, None, None]
    tp4 = plans[-1]
    assert tp4.hbm_bytes == HBM["v5p"] == 95 * 2**30
    # tp=4 splits every weight 4 ways except the few vectors tp cannot reach (layer scalars).
    assert 2 * 30_697_345_340 / 4 <= tp4.base_bytes < 2 * 30_697_345_340 / 4 * 1.001
    assert str(tp4).startswith("fsdp=1 tp=4: base 14.29 GiB") and str(tp4).endswith("of 95.00 GiB: fits")
    with pytest.raises(MeshError, match="unknown chip 'v7'"):
        memory_plan(G31, 4, 1, hbm_bytes="v7")
    with pytest.raises(MeshError, match="tp=8 does not divide"):
        memory_plan(G31, 1, 8)


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    """Enough of a device for JAX's mesh utilities to lay out slices (real multi-slice needs TPUs)."""

    id: int
    slice_index: int
    process_index: int
    platform: str = "cpu"
    device_kind: str = "cpu"


def test_multislice_puts_slices_along_fsdp():
    two_slices = [FakeDevice(i, i // 4, i // 4) for i in range(8)]
    mesh = make_mesh(G31, tp=4, devices=two_slices)
    assert [[d.slice_index for d in row] for row in mesh.devices] == [[0, 0, 0, 0], [1, 1, 1, 1]]
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    four_slices = [FakeDevice(i, i // 2, i // 2) for i in range(8)]
    with pytest.raises(MeshError, match="fsdp=2 does not divide by the 4 slices"):
        make_mesh(G31, fsdp=2, tp=4, devices=four_slices)
