"""The train step compiled for a TPU slice on this CPU host: libtpu's compiler, compile-only devices, no TPU.

``gemport.mesh.tpu`` names slices as Cloud TPU does and gives their chips as JAX devices of the slice's
topology; the step gemport trains with, lowered on a mesh of them, compiles as the slice would run it: splash
attention through Mosaic (``tpu_custom_call``), not in interpret mode, sharded per device under ``shard_map``.
"""

import contextlib
import dataclasses
import re
import subprocess
import sys

import jax.numpy as jnp
import pytest

from gemport.errors import MeshError
from gemport.step import segment_loss, tunix_loss
from gemport.step.attention import SPLASH_BLOCKS
from gemport.lora import LoraSpec
from gemport.mesh import TpuSlice, make_mesh, slice_devices
from gemport.mesh.tpu import platform


@pytest.mark.parametrize("name, chips, grid, host", [
    ("v5p-8", 4, (2, 2, 1), (2, 2, 1)),
    ("v5p-16", 8, (2, 2, 2), (2, 2, 1)),
    ("v5p-64", 32, (2, 4, 4), (2, 2, 1)),
    ("v6e-1", 1, (1, 1), (1, 1, 1)),
    ("v6e-8", 8, (2, 4), (2, 4, 1)),
    ("v6e-32", 32, (4, 8), (2, 2, 1)),
    ("v5litepod-16", 16, (4, 4), (2, 2, 1)),
])
def test_a_slice_name_is_cloud_tpus_accelerator_type(name, chips, grid, host):
    tpu = TpuSlice.parse(name)
    assert (tpu.chips, tpu.grid, tpu.host) == (chips, grid, host)
    assert tpu.topology == f"{tpu.generation}:{'x'.join(map(str, grid))}"


@pytest.mark.parametrize("name, says", [
    ("v4-8", "unknown TPU slice 'v4-8'"),
    ("v5p", "unknown TPU slice 'v5p'"),
    ("v5p-6", "6 TensorCores (2 per chip) is not a slice's size"),
    ("v5p-9", "9 TensorCores"),
    ("v6e-12", "12 chips is not a slice's size"),
    ("v6e-0", "0 chips"),
])
def test_a_bad_slice_name_is_a_mesh_error_naming_it(name, says):
    with pytest.raises(MeshError, match=re.escape(says)):
        TpuSlice.parse(name)


def test_a_slice_is_its_chips_as_compile_only_tpu_devices():
    for name, kind in (("v5p-8", "TPU v5"), ("v6e-8", "TPU v6 lite")):
        devices = slice_devices(name)
        assert len(devices) == TpuSlice.parse(name).chips
        assert {(d.platform, d.device_kind) for d in devices} == {("tpu", kind)}
    assert {d.process_index for d in slice_devices("v5p-16")} == {0, 1}  # two hosts of four chips


def test_without_libtpu_the_slice_is_a_mesh_error_saying_what_to_install():
    code = ("import sys; sys.modules['libtpu'] = None\n"
            "from gemport.mesh.tpu import slice_devices\n"
            "from gemport.errors import MeshError\n"
            "try:\n    slice_devices('v5p-8')\nexcept MeshError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={"JAX_PLATFORMS": "cpu", "PATH": ""})
    assert "needs libtpu, the TPU compiler: pip install 'gemport[tpu]'" in out.stdout, out.stderr[-2000:]


def _scores(text, t):
    # Arrays with two dimensions of the row's length: [.., T, .., T, ..] scores or masks.
    return re.findall(rf"\[(?:\d+,)*{t},(?:\d+,)*{t}(?:,\d+)*\]", text)


@pytest.fixture(scope="module")
def compiled_for_v5p():
    """{fast: compiled train step} of a 2-layer tiny Gemma 4 (sliding, then global) with LoRA, bf16, 4 rows of 256
    tokens, on a v5p-8's 4 chips as fsdp=2 x tp=2, for the fast step and Tunix's (``HFPeftTrainer(loss_fn=)``)."""
    import tiny
    from gemport.plan.compiled import compile_step, step_trainer
    from gemport.specs import GemmaSpec
    from gemport.run.model import lora_model

    spec = dataclasses.replace(GemmaSpec.from_hf(tiny.text_config("gemma4_mesh").to_dict()), num_layers=2,
                               layer_types=("sliding", "global"))
    mesh = make_mesh(spec, fsdp=2, tp=2, devices=slice_devices("v5p-8"))
    out = {}
    for fast in (True, False):
        model = lora_model(spec, LoraSpec(4, 8.0), param_dtype=jnp.bfloat16)
        out[fast] = compile_step(step_trainer(model, loss_fn=segment_loss if fast else tunix_loss), mesh, 4, 256)
    return out


def test_the_fast_step_compiles_for_the_slice_on_splash_kernels_without_scores(compiled_for_v5p):
    fast, tunix = (compiled_for_v5p[k].executable.as_text() for k in (True, False))
    # Each layer: the forward kernel, and the backward's fused dq-and-dkv kernel (or its dq and dkv kernels).
    per_layer = 2 if SPLASH_BLOCKS.get("use_fused_bwd_kernel") else 3
    assert fast.count('custom_call_target="tpu_custom_call"') >= per_layer * 2
    assert not _scores(fast, 256)
    assert 'custom_call_target="tpu_custom_call"' not in tunix and _scores(tunix, 256)  # its [B, T, N, S] scores
    assert all(c.peak_bytes > 0 and c.products.flops > 0 for c in compiled_for_v5p.values())


def test_the_platform_a_trace_compiles_for_is_the_meshs():
    import jax

    seen = []
    with jax.set_mesh(make_mesh(_spec(), fsdp=4, tp=1, devices=slice_devices("v5p-8"))):
        jax.jit(lambda x: seen.append(platform()) or x).trace(jax.ShapeDtypeStruct((4,), jnp.float32))
    assert seen == ["tpu"] and platform() == "cpu"


def _spec():
    import tiny
    from gemport.specs import GemmaSpec

    return GemmaSpec.from_hf(tiny.text_config("gemma4_mesh").to_dict())


def test_plan_compiles_the_step_for_the_slice(hf_checkpoint):
    from gemport_cli import gemport, one_line_error

    _, base = hf_checkpoint("gemma4_dense")
    out = gemport("plan", base, "--tpu", "v5p-8", "--lora-rank", "4", "--batch", "4", "--seq-len", "64",
                  "--compile").stdout
    assert "valid (fsdp, tp) meshes on a v5p-8 (4 chips)" in out and "of 95.00 GiB" in out
    lines = [line for line in out.splitlines() if "compiled peak" in line]
    assert lines and all("compiled peak (TPU v5p-8, libtpu's compiler, the step SFTRun.train() runs)" in line
                         for line in lines), out
    one_line_error(gemport("plan", base, "--tpu", "v5p-6", ok=False), "v5p-6", "not a slice's size")
    one_line_error(gemport("plan", base, "--tpu", "v5p-8", "--devices", "8", ok=False), "--devices 8", "4 chips")
    one_line_error(gemport("plan", base, ok=False), "--tpu", "--devices")


def test_tunix_constrains_activations_in_a_step_compiled_for_the_slice():
    """Tunix applies its activation constraints only on a process whose own devices are accelerators: a step
    traced on this CPU host for the slice's chips gets them as the slice's run does, and Tunix is left as it
    was afterwards."""
    import jax
    from flax import nnx
    from tunix.utils import sharding_utils

    from gemport._src.upstream import tunix_shard_on
    from gemport.run.model import lora_model
    from gemport.mesh.context import use_mesh

    spec = _spec()
    graphdef, state = nnx.split(lora_model(spec, LoraSpec(4, 8.0)))
    rows = jax.ShapeDtypeStruct((4, 16), jnp.int32)
    mask = jax.ShapeDtypeStruct((4, 16, 16), jnp.bool_)

    def constraints(mesh, patched):
        def forward(state, tokens, mask):  # a new function each time: JAX reuses the trace of a function it has seen
            return nnx.merge(graphdef, state)(tokens, tokens, None, mask)[0]

        with use_mesh(mesh), (tunix_shard_on(mesh) if patched else contextlib.nullcontext()):
            return jax.jit(forward).lower(state, rows, mask).as_text().count("sharding_constraint")

    shard = sharding_utils.shard
    slice_mesh = make_mesh(spec, fsdp=2, tp=2, devices=slice_devices("v5p-8"))
    assert constraints(slice_mesh, False) == 0  # what Tunix alone would trace here
    assert constraints(slice_mesh, True) >= 2 * spec.num_layers
    assert sharding_utils.shard is shard
    host_mesh = make_mesh(spec, fsdp=2, tp=2, devices=jax.devices()[:4])
    assert constraints(host_mesh, True) == 0  # on the host's own devices, Tunix decides as it does in training


@pytest.mark.parametrize("bf16, tf32, width", [(False, None, 512), (False, None, 256), (False, True, 512),
                                              (False, True, 256), (True, None, 512)])
def test_splash_attention_compiles_for_a_v5e_at_each_recipes_precision_and_gemmas_head_widths(bf16, tf32, width):
    """Splash attention forward and backward on 2 rows of 2048 tokens, compiled for one v5e at a recipe's dtype and
    precision (``step.precision``): float32 ("highest"), float32 with tf32 ("high") and bfloat16 ("default").
    Found on the chip: at 512-row tiles, float32 at Gemma 4's global width (512) ran out of the kernels' 16 MiB
    scoped VMEM (28 MiB), so wider heads take fewer rows (``step.attention.SPLASH_TILE_BYTES``); and Mosaic
    compiles no "high" products, so under tf32 the kernels run at "highest"."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from gemport.mesh.dims import FSDP
    from gemport.step.attention import attend
    from gemport.step.precision import matmul_precision, with_precision

    mesh = jax.sharding.Mesh(np.array(slice_devices("v5e-1")), (FSDP,))
    rows = NamedSharding(mesh, PartitionSpec())
    dtype = jnp.bfloat16 if bf16 else jnp.float32
    q = jax.ShapeDtypeStruct((2, 2048, 8, width), dtype, sharding=rows)
    k = jax.ShapeDtypeStruct((2, 2048, 1, width), dtype, sharding=rows)
    seg = jax.ShapeDtypeStruct((2, 2048), jnp.int32, sharding=rows)

    def forward_backward(q, k, seg):
        out, pull = jax.vjp(lambda q, k: attend(q, k, k, seg, None), q, k)
        return out, pull(out)

    with jax.set_mesh(mesh):
        step = with_precision(forward_backward, matmul_precision(bf16, tf32))
        compiled = jax.jit(step).lower(q, k, seg).compile()
    assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 2
