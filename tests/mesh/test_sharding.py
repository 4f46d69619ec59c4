"""Sharding on 8 simulated CPU devices: a real LoRA training step on a 2x4 mesh, the rank-mismatch repair,
the memory plan against the bytes of real sharded arrays, and optimizer-state shardings."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import qwix
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import tiny
from gemport.checkpoint import load_model
from gemport.errors import MeshError
from gemport.lora import LoraLayout, LoraParams, LoraSpec, apply_lora
from gemport.mesh import make_mesh
from gemport.plan import memory_plan
from gemport._src.params import lora_state
from gemport.mesh import audit, fix_lora, optimizer_shardings
from gemport.specs import GemmaSpec
from mesh24 import mesh24_causal_lm

TARGETS = ".*/(q_einsum|kv_einsum|k_einsum|attn_vec_einsum|gate_proj|up_proj|down_proj)"
RANK = 4
EXPECTED_LORA = {
    "attn.q_einsum.w": (("fsdp", None), (None, "tp", None)),
    "attn.kv_einsum.w": (("fsdp", None), (None, None, "tp", None)),  # Qwix's shared A; gemport: SEPARATE_KV
    "attn.k_einsum.w": (("fsdp", None), (None, "tp", None)),
    "attn.attn_vec_einsum.w": (("tp", None, None), (None, "fsdp")),
    "mlp.gate_proj.kernel": (("fsdp", None), (None, "tp")),
    "mlp.up_proj.kernel": (("fsdp", None), (None, "tp")),
    "mlp.down_proj.kernel": (("tp", None), (None, "fsdp")),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("mesh24")
    mesh24_causal_lm().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def spec(ckpt):
    return GemmaSpec.from_hf(ckpt)


@pytest.fixture(scope="module")
def mesh(spec):
    return make_mesh(spec, fsdp=2, tp=4)


SEPARATE_KV = ((None, "fsdp", None), (None, None, "tp", None))


def lora_spec_of(builder):
    """The LoraSpec describing what ``builder`` puts on the model: plain Qwix shares A across K and V."""
    return LoraSpec(RANK, 8.0, fused="shared" if builder == "qwix" else "separate")


def lora_model(ckpt, mesh, builder):
    """Plain Qwix (a model built elsewhere) or gemport's apply_lora (separate K and V factors)."""
    model = load_model(ckpt, mesh=mesh)

    def build():
        if builder == "gemport":
            return apply_lora(model, GemmaSpec.from_hf(ckpt), lora_spec_of(builder), seed=1)
        provider = qwix.LoraProvider(module_path=TARGETS, rank=RANK, alpha=8.0)
        return qwix.apply_lora_to_model(model, provider, rngs=nnx.Rngs(1), **model.get_model_input())

    if mesh is None:
        return build()
    with jax.set_mesh(mesh):
        return build()


def place_by_annotations(state, mesh):
    """What Tunix's reshard_model_to_mesh and a train-state setup do: put every array where its annotation says."""
    return jax.device_put(state, nnx.get_named_sharding(state, mesh))


@pytest.fixture(scope="module", params=["qwix", "gemport"])
def builder(request):
    return request.param


@pytest.fixture(scope="module")
def single(ckpt, builder):
    return lora_model(ckpt, None, builder)


@pytest.fixture(scope="module")
def sharded(ckpt, mesh, single, builder):
    return lora_model(ckpt, mesh, builder)


def lora_paths(model):
    return {".".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))}


def loss_fn(model, ids):
    b, t = ids.shape[0], ids.shape[1] - 1
    positions = jnp.tile(jnp.arange(t)[None], (b, 1))
    mask = jnp.tril(jnp.ones((b, t, t), bool))
    logits, _ = model(ids[:, :-1], positions, None, mask)
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


@nnx.jit
def train_step(model, optimizer, ids):
    loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(model, ids)
    optimizer.update(model, grads)
    return loss


def train(model, mesh, steps=2):
    ids = jnp.asarray(tiny.token_ids(128, batch=4, seq=9))
    tx = optax.adamw(1e-2)
    if mesh is None:
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)
        return [float(train_step(model, optimizer, ids)) for _ in range(steps)], optimizer
    with jax.set_mesh(mesh):
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)
        return [float(train_step(model, optimizer, ids)) for _ in range(steps)], optimizer


def test_qwix_lora_annotations_agree_with_fix_lora(sharded, mesh, builder, spec):
    assert fix_lora(nnx.clone(sharded), mesh) == ()
    found = lora_paths(sharded)
    assert len(found) == 2 * (len(EXPECTED_LORA) - 1) * 2  # kv_einsum on the sliding layer, k_einsum on the global
    base = {".".join(map(str, p)): tuple(v.get_metadata().get("out_sharding", ()))
            for p, v in nnx.to_flat_state(nnx.state(sharded, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))))}
    assert {k: tuple(v.get_metadata()["out_sharding"]) for k, v in found.items()} == \
        LoraLayout(spec, lora_spec_of(builder)).specs(base)
    for path, var in found.items():
        weight, factor = path.split(".", 2)[2].rsplit("_lora_", 1)
        expected = EXPECTED_LORA[weight][factor == "b"]
        if weight == "attn.kv_einsum.w" and builder == "gemport":
            expected = SEPARATE_KV[factor == "b"]
        assert tuple(var.get_metadata()["out_sharding"]) == expected, path
        assert var.get_value().sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec(*expected)), var.ndim)


def test_given_lora_params_land_in_the_mesh_shardings_without_fix_lora(ckpt, spec, mesh):
    """apply_lora with LoraParams (host arrays, e.g. an imported adapter) places each factor as a fresh one."""
    lora_spec = lora_spec_of("gemport")
    rng = np.random.default_rng(0)
    given = LoraParams(lora_state({k: rng.normal(size=s).astype(np.float32)
                                   for k, s in LoraLayout(spec, lora_spec).shapes().items()}), lora_spec)
    with jax.set_mesh(mesh):
        model = apply_lora(load_model(ckpt, mesh=mesh), spec, given)
    found = lora_paths(model)
    assert found.keys() == given.flat().keys()
    for path, var in found.items():
        want = NamedSharding(mesh, PartitionSpec(*var.get_metadata()["out_sharding"]))
        assert var.get_value().sharding.is_equivalent_to(want, var.ndim), path
        np.testing.assert_array_equal(np.asarray(var.get_value()), given.flat()[path], err_msg=path)
    assert fix_lora(model, mesh) == ()
    assert not audit(model, mesh).problems


@pytest.fixture(scope="module")
def trained(sharded, mesh):
    model = nnx.clone(sharded)
    losses, optimizer = train(model, mesh)
    return model, optimizer, losses


def test_training_step_on_2x4_matches_one_device(single, trained, mesh):
    model, optimizer, losses = trained
    single_losses, _ = train(nnx.clone(single), None)
    np.testing.assert_allclose(losses, single_losses, rtol=0, atol=1e-5)
    assert losses[1] < losses[0]
    # k_einsum (the K=V projection of the global layer) is trained.
    assert float(jnp.abs(model.layers[1].attn.k_einsum.w_lora_b.get_value()).max()) > 0

    rows = [*audit(model, mesh), *audit(optimizer, mesh)]
    assert not [(r.path, r.findings) for r in rows if r.findings]
    arrays = {}
    for state in (nnx.state(model), nnx.state(optimizer)):
        arrays.update({".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(state)})
    for row in rows:
        array = arrays[row.path]
        assert array.sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec(*row.spec)), array.ndim), row
        assert array.addressable_shards[0].data.nbytes == row.bytes_per_device, row
    lora = lora_paths(model)
    moments = [r for r in rows if r.path.split(".")[2:3] in (["mu"], ["nu"])]
    assert len(moments) == 2 * len(lora)
    for row in moments:
        assert row.spec == tuple(lora[row.path.split(".", 3)[3]].get_metadata()["out_sharding"]), row


def scanned_like(model):
    """Annotate each LoRA factor with its base weight's full spec, as LoRA under scanned layers ends up."""
    broken = []
    for path, module in nnx.iter_modules(model):
        for name in list(vars(module)):
            if name.endswith(("_lora_a", "_lora_b")):
                base = getattr(module, name[:-7])
                getattr(module, name).set_metadata("out_sharding", (None, *base.get_metadata()["out_sharding"]))
                broken.append(".".join(map(str, path)) + "." + name)
    return broken


def test_rank_mismatch_fails_without_fix_lora_and_trains_with_it(sharded, mesh):
    model = nnx.clone(sharded)
    broken = scanned_like(model)
    report = audit(model, mesh)
    assert all(report[p].findings[0].startswith("spec longer than rank") for p in broken)
    with pytest.raises(ValueError, match="is only valid for values of rank at least"):
        place_by_annotations(nnx.state(model), mesh)

    changes = fix_lora(model, mesh)
    assert sorted(c.path for c in changes) == sorted(broken)
    assert all(c.reason.startswith("spec of length") for c in changes)
    assert fix_lora(model, mesh) == ()
    nnx.update(model, place_by_annotations(nnx.state(model), mesh))
    losses, optimizer = train(model, mesh, steps=1)
    assert np.isfinite(losses[0])
    assert not audit(model, mesh).problems and not audit(optimizer, mesh).problems


class Proj(nnx.Module):
    def __init__(self, n):
        self.einsum_str = "BTD,NDH->BTNH"
        self.w = nnx.Param(jnp.ones((n, 8, 4)), out_sharding=("tp", "fsdp", None))
        self.w_lora_a = nnx.LoRAParam(jnp.ones((8, 2)))
        self.w_lora_b = nnx.LoRAParam(jnp.ones((2, n, 4)))


def test_fix_lora_replicates_only_what_does_not_divide(mesh):
    with jax.set_mesh(mesh):
        model = nnx.Dict(good=Proj(8), odd=Proj(6))
    changes = {c.path: c for c in fix_lora(model, mesh)}
    assert {p: c.new for p, c in changes.items()} == {
        "good.w_lora_a": ("fsdp", None),
        "good.w_lora_b": (None, "tp", None),
        "odd.w_lora_a": ("fsdp", None),
        "odd.w_lora_b": (None, None, None),
    }
    assert "dim 1 of size 6 does not divide by tp=4: replicated" in changes["odd.w_lora_b"].reason
    assert "does not divide" not in changes["good.w_lora_b"].reason
    assert model["odd"].w_lora_b.get_value().sharding.is_fully_replicated
    assert model["good"].w_lora_b.get_value().sharding.spec == PartitionSpec(None, "tp", None)
    with pytest.raises(MeshError, match="needs the model"):
        fix_lora(nnx.state(model), mesh)


def test_memory_plan_equals_bytes_of_sharded_arrays(trained, spec, mesh, builder):
    model, optimizer, _ = trained
    plan = memory_plan(spec, 2, 4, lora_spec=lora_spec_of(builder), param_dtype="float32")

    def on_device0(state):
        device = mesh.devices.flat[0]
        return sum(
            s.data.nbytes
            for leaf in jax.tree.leaves(state)
            for s in leaf.addressable_shards
            if s.device == device
        )

    base = nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
    assert plan.base_bytes == on_device0(base)
    assert plan.lora_bytes == on_device0(nnx.state(model, nnx.LoRAParam))
    adam = optimizer.opt_state[0]
    assert plan.optimizer_bytes == on_device0(adam.mu) + on_device0(adam.nu)
    assert plan.lora_bytes > 0 and plan.optimizer_bytes == 2 * plan.lora_bytes
    bf16_moments = memory_plan(spec, 2, 4, lora_spec=lora_spec_of(builder), param_dtype="float32",
                               moments_dtype="bfloat16")
    assert bf16_moments.optimizer_bytes == plan.lora_bytes


@pytest.mark.parametrize(
    "make_tx",
    [
        lambda: optax.adamw(1e-3),
        lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3),
        lambda: optax.MultiSteps(optax.adamw(1e-3), every_k_schedule=2),
        lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
        lambda: optax.masked(optax.adamw(1e-3), lambda p: jax.tree.map(lambda x: x.ndim == 2, p)),
    ],
    ids=["adamw", "inject_hyperparams", "MultiSteps", "chain", "masked"],
)
def test_optimizer_shardings_follow_params(sharded, mesh, make_tx):
    tx = make_tx()
    params = nnx.state(sharded, nnx.LoRAParam)
    shardings = optimizer_shardings(tx, params)
    state = jax.jit(tx.init, out_shardings=shardings)(nnx.as_pure(params))
    by_spec = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        for i in range(len(keys)):
            name = ".".join(keys[i:])
            if name in lora_paths(sharded):
                var = lora_paths(sharded)[name]
                assert leaf.sharding.spec == PartitionSpec(*var.get_metadata()["out_sharding"]), keys
                by_spec[name] = by_spec.get(name, 0) + 1
                break
        else:
            assert leaf.ndim == 0 and leaf.sharding.is_fully_replicated, keys
    assert by_spec, "no param-shaped state found"


def test_optimizer_shardings_refuses_unmatched_state(sharded, mesh):
    params = nnx.state(sharded, nnx.LoRAParam)
    with pytest.raises(MeshError, match="matches no param"):
        optimizer_shardings(optax.adafactor(1e-3, min_dim_size_to_factor=2), params)


def test_memory_plan_skips_kv_shared_layers_as_qwix_does(tmp_path):
    # gemma4_ple: the last two layers reuse earlier K/V, so their kv_einsum never runs and gets no LoRA.
    tiny.causal_lm("gemma4_ple").save_pretrained(tmp_path)
    spec = GemmaSpec.from_hf(tmp_path)

    def build():
        model = spec.tunix_model_class()(spec.to_tunix(), rngs=nnx.Rngs(0))
        provider = qwix.LoraProvider(module_path=TARGETS, rank=RANK, alpha=8.0)
        return qwix.apply_lora_to_model(model, provider, rngs=nnx.Rngs(1), **model.get_model_input())

    model = nnx.eval_shape(build)
    lora = nnx.state(model, nnx.LoRAParam)
    assert not any("layers.6.attn.kv_einsum" in ".".join(map(str, p)) for p, _ in nnx.to_flat_state(lora))
    plan = memory_plan(spec, 1, 1, lora_spec=lora_spec_of("qwix"), param_dtype="float32")
    nbytes = lambda state: sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state))  # noqa: E731
    assert plan.lora_bytes == nbytes(lora)
    assert plan.base_bytes == nbytes(nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))))


def test_audit_findings_and_table(mesh):
    arrays = {
        "long": ((8, 4), ("fsdp", None, "tp")),
        "unknown": ((8, 4), ("data", None)),
        "odd": ((6, 4), ("tp",)),
        "big": ((512, 512), ()),
        "moved": ((8, 4), ("fsdp", None)),
        "ok": ((8, 4), ("fsdp", "tp")),
    }
    state = {}
    for name, (shape, spec) in arrays.items():
        placed = PartitionSpec("fsdp", "tp") if name == "ok" else PartitionSpec()
        state[name] = nnx.Param(jax.device_put(jnp.ones(shape), NamedSharding(mesh, placed)))
        state[name].set_metadata("out_sharding", spec)
    report = audit(nnx.State(state), mesh)
    findings = {r.path: r.findings for r in report}
    assert findings["long"] == ("spec longer than rank (3 > 2)",)
    assert findings["unknown"] == ("unknown axis 'data' (mesh has fsdp, tp)",)
    assert findings["odd"] == ("indivisible: dim 0 of size 6 by tp=4",)
    assert findings["big"] == ("large tensor replicated (1,048,576 bytes on every device)",)
    assert findings["moved"][0].startswith("placed as NamedSharding") and "spec=P()" in findings["moved"][0]
    assert findings["ok"] == ()
    # Bytes per device: indivisible dims padded as JAX does (ceil(6 / 4) = 2 rows of 4 float32).
    assert {r.path: r.bytes_per_device for r in report} == {
        "long": 64, "unknown": 128, "odd": 32, "big": 2**20, "moved": 64, "ok": 16,
    }  # fmt: skip
    assert [r.path for r in report.problems] == ["big", "long", "moved", "odd", "unknown"]
    lines = str(report).splitlines()
    assert lines[0].split() == ["path", "shape", "dtype", "spec", "bytes/device", "finding"]
    assert lines[1].startswith("!") and "big" in lines[1] and "1,048,576" in lines[1]
    assert lines[-1].split()[:3] == ["total", f"{report.bytes_per_device:,}", "5"]
