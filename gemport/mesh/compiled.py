"""A LoRA train step on a Tunix Gemma model, and the peak memory XLA compiles it to, nothing allocated.

The step is what a trainer does per batch: forward, the masked cross-entropy (gemport's fast loss,
``train.fast_loss``, or Tunix's logits with ``masked_cross_entropy``), gradients of the LoRA params only
(``nnx.LoRAParam``), an ``optax.adamw`` update; the LoRA params and Adam state are donated, as a trainer that
keeps one copy of its state does. ``compile_step`` lowers and compiles it for abstract inputs (shapes and
shardings only, ``nnx.eval_shape``), so a model of any size is measured without materialising it. On CPU, set
``CPU_MEMORY_SCHEDULER`` in ``XLA_FLAGS`` before JAX starts; XLA:CPU computes bfloat16 in float32, so its
figure for a bf16 model includes float32 copies of weights a TPU would not make.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from gemport import names
from gemport.checkpoint.quantize import how_to_quantize, set_quantized
from gemport.lora import LoraSpec, QLoraSpec, apply_lora
from gemport.lora.qlora import is_quantized
from gemport.masks.loss import masked_cross_entropy
from gemport.mesh.context import use_mesh
from gemport.mesh.dims import FSDP
from gemport._src.params import path_str
from gemport._src.partition import padded, spec_of
from gemport.sharding import optimizer_shardings
from gemport.specs import GemmaSpec
from gemport.train import fast_loss


# XLA:CPU orders a program for concurrency by default: it runs every layer's rematerialisation as early
# as its inputs allow, so remat saves nothing. Accelerators schedule for memory; with this flag in XLA_FLAGS
# (set before JAX starts; a per-compile option does not reach the CPU scheduler) so does the CPU.
CPU_MEMORY_SCHEDULER = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def set_remat(model, family: str, remat: str):
    """Set Tunix's ``remat_config`` of ``model`` to ``remat`` ("none", "block", "decoder"), in place.

    Qwix creates the LoRA params on a first call, which fails inside ``nnx.remat``; so a model gets its
    LoRA without remat and the remat policy afterwards. Gemma 3's attention keeps its own copy of the field.
    """
    value = __import__(f"tunix.models.{family}.model", fromlist=["RematConfig"]).RematConfig[remat.upper()]
    for _, module in nnx.iter_modules(model):
        for holder in (module, getattr(module, "config", None)):
            if hasattr(holder, "remat_config"):
                holder.remat_config = value


def quantize_base(model, spec: GemmaSpec, qlora: QLoraSpec):
    """Make every projection weight of ``model`` (in place) the 4-bit base ``load_qlora_model`` places: a Qwix
    ``WithAux(QArray)`` of uint4 codes and float32 scales in bitsandbytes' blocks (``how_to_quantize``). The
    codes are Qwix's quantization of the weights the model holds; shapes, dtypes and shardings are the
    loader's, which is what a compile measures."""
    from qwix._src.core import qarray

    by_path = {e.tunix: e for e in names.entries(spec)}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        entry = by_path[path_str(path)]
        if not is_quantized(entry):
            continue
        how = how_to_quantize(entry, qlora)
        q = qarray.quantize(var.get_value(), how)
        set_quantized(model, path, qarray.QArray(q.qvalue, q.scale.astype(jnp.float32), qtype=q.qtype), how)


def lora_model(spec: GemmaSpec, lora_spec: LoraSpec, *, param_dtype=jnp.bfloat16, remat: str = "none",
               abstract: bool = True, qlora: QLoraSpec | None = None):
    """A Tunix model of ``spec`` with Qwix LoRA per ``lora_spec``: shapes only (``abstract``) or random; on a
    4-bit base (``quantize_base``) with ``qlora``, its LoRA factors float32 as Qwix makes them there."""
    cfg = spec.to_tunix(param_dtype=param_dtype)

    def build():
        with nnx.var_defaults(ref=True):
            rngs = nnx.Rngs(0)
        model = spec.tunix_model_class()(cfg, rngs=rngs)
        if qlora is not None:
            quantize_base(model, spec, qlora)
        return apply_lora(model, spec, lora_spec, qlora=qlora)

    model = nnx.eval_shape(build) if abstract else build()
    set_remat(model, spec.family, remat)
    return model


def batch_shapes(batch: int, seq_len: int, fast: bool = False) -> dict[str, jax.ShapeDtypeStruct]:
    """One batch of packed rows: tokens, positions [B, T] int32, loss_mask [B, T] bool; and segment_ids [B, T]
    int32 (``fast``) or attention_mask [B, T, T] bool (Tunix's attention)."""
    rows = {
        "tokens": jax.ShapeDtypeStruct((batch, seq_len), jnp.int32),
        "positions": jax.ShapeDtypeStruct((batch, seq_len), jnp.int32),
        "loss_mask": jax.ShapeDtypeStruct((batch, seq_len), jnp.bool_),
    }
    if fast:
        rows["segment_ids"] = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
    else:
        rows["attention_mask"] = jax.ShapeDtypeStruct((batch, seq_len, seq_len), jnp.bool_)
    return rows


def make_step(graphdef, tx: optax.GradientTransformation, fast: bool = False):
    """``step(lora, opt_state, rest, batch) -> (lora, opt_state, loss)``, jitted, LoRA and Adam state donated.

    fast: the loss of ``gemport.train.fast_loss`` (segment attention, chunked cross-entropy), else Tunix's
    attention and logits with ``masked_cross_entropy``."""

    def step(lora, opt_state, rest, batch):
        def loss_fn(lora):
            model = nnx.merge(graphdef, lora, rest)
            if fast:
                summed, count = fast_loss(model, batch)
                return summed / jnp.maximum(count, 1)
            logits, _ = model(batch["tokens"], batch["positions"], None, batch["attention_mask"])
            return masked_cross_entropy(logits, batch["tokens"], batch["loss_mask"])

        loss, grads = jax.value_and_grad(loss_fn)(lora)
        updates, opt_state = tx.update(grads, opt_state, lora)
        return optax.apply_updates(lora, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def _placed(state, mesh):
    """Abstract arrays of ``state`` (pure), each with the NamedSharding of its annotation on ``mesh``."""

    def one(var):
        value = var.get_value()
        spec = padded(spec_of(var), value.ndim)[: value.ndim]
        spec = tuple(None if a is not None and value.shape[i] % mesh.shape[a] else a for i, a in enumerate(spec))
        return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=NamedSharding(mesh, PartitionSpec(*spec)))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


@contextlib.contextmanager
def _tunix_constraints(mesh):
    # Tunix constrains activations to its layouts (``tunix.utils.sharding_utils.shard``) only when the process's
    # own devices are accelerators. Traced on a CPU host for a TPU slice's compile-only devices, the step would
    # lack the constraints the slice's run has, and XLA would reshard activations between rows and widths
    # (all-to-alls of [B, T, D]) where the slice gathers weights. While it is traced, Tunix's models constrain
    # on ``mesh`` as they do on the slice; a mesh of the host's own devices keeps Tunix's behaviour.
    if mesh.devices.flat[0].platform == jax.devices()[0].platform:
        yield
        return
    from tunix.models.gemma4 import model as gemma4
    from tunix.utils import sharding_utils

    def shard(x, spec, eager=False):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*spec)))

    saved = sharding_utils.shard, gemma4.shard
    sharding_utils.shard = gemma4.shard = shard
    try:
        yield
    finally:
        sharding_utils.shard, gemma4.shard = saved


@dataclasses.dataclass(frozen=True)
class Compiled:
    """Per-device bytes of a compiled step (XLA's ``memory_analysis``) and the step itself."""

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    executable: object

    @property
    def peak_bytes(self) -> int:
        """Arguments + outputs + temporaries, donated buffers counted once."""
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes


def compile_step(model, mesh, batch: int, seq_len: int, tx: optax.GradientTransformation | None = None,
                 fast: bool = False):
    """Lower and compile the LoRA step of ``model`` (abstract or concrete) for one batch shape on ``mesh``.

    The batch is sharded over fsdp (rows), params by their Tunix/Qwix annotations, Adam state like the
    LoRA params; ``fast`` as ``make_step``'s. The step is traced under ``use_mesh(mesh)``, as training runs
    it; for a TPU slice's compile-only devices (``mesh.tpu.slice_devices``) with Tunix's activation
    constraints, as on the slice. Returns ``(Compiled, args)``: ``args`` are the abstract arguments, in call order.
    """
    tx = tx or optax.adamw(1e-4)
    graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
    lora_in, rest_in = _placed(lora, mesh), _placed(rest, mesh)
    opt_shardings = optimizer_shardings(tx, nnx.as_pure(lora_in), mesh)
    opt_in = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          jax.eval_shape(tx.init, nnx.as_pure(lora_in)), opt_shardings)
    rows = NamedSharding(mesh, PartitionSpec(FSDP))
    batch_in = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=rows) for k, v in batch_shapes(batch, seq_len, fast).items()}
    args = (lora_in, opt_in, rest_in, batch_in)
    with use_mesh(mesh), _tunix_constraints(mesh):
        executable = make_step(graphdef, tx, fast).lower(*args).compile()
    m = executable.memory_analysis()
    return Compiled(m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes,
                    m.alias_size_in_bytes, executable), args


def state_bytes(tree) -> int:
    """Bytes of every array leaf of ``tree`` on one device (its largest shard)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
        total += int(np.prod(shape)) * np.dtype(leaf.dtype).itemsize
    return total


__all__ = ["CPU_MEMORY_SCHEDULER", "Compiled", "batch_shapes", "compile_step", "lora_model", "make_step",
           "quantize_base", "set_remat", "state_bytes"]
