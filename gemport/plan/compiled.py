"""The train step gemport runs, lowered and compiled for abstract arguments: per-device memory and FLOPs, nothing
allocated.

There is one train step: ``HFPeftTrainer.jitted_train_step()``, the function ``SFTRun.train()`` runs (Tunix's
``nnx.jit`` of the trainer's step: one micro-batch's ``hf_loss`` and LoRA gradients, the recipe's optimizer with
its accumulation (``optax.MultiSteps``), clipping and schedule, the model and optimizer state donated). ``lower_step`` lowers
it for a micro-batch's shapes on a mesh, the model and optimizer state as shapes and shardings only, so a model of
any size is measured without materialising it; ``tests/plan/test_one_step.py`` holds the lowering to the program
``train()`` compiles. On CPU, set ``CPU_MEMORY_SCHEDULER`` in ``XLA_FLAGS`` before JAX starts; XLA:CPU computes
bfloat16 in float32, so its figure for a bf16 model includes float32 copies of weights a TPU would not make.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from gemport.errors import MeshError
from gemport.plan.flops import ProductFlops, product_flops
from gemport.lora import LoraSpec, QLoraSpec
from gemport.mesh.context import use_mesh
from gemport._src import upstream
from gemport._src.partition import padded, spec_of
from gemport.specs import GemmaSpec
from gemport.run.model import lora_model
from gemport.step.hf import LossFn, segment_loss
from gemport.data.batching import BATCH_FIELDS
from gemport.run.trainer import ACCUMULATION, NUM_ITEMS, HFPeftTrainer
from gemport.optim import hf_optimizer
from gemport.run.sft import sft_fields, training_config
from gemport.recipe import RunFields
from gemport.step.precision import matmul_precision
from gemport.mesh.factory import make_mesh
from gemport.mesh.tpu import slice_devices
from gemport.data.sft import remat_of

# XLA:CPU orders a program for concurrency by default: it runs every layer's rematerialisation as early
# as its inputs allow, so remat saves nothing. Accelerators schedule for memory; with this flag in XLA_FLAGS
# (set before JAX starts; a per-compile option does not reach the CPU scheduler) so does the CPU.
CPU_MEMORY_SCHEDULER = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def micro_batch_shapes(rows: int, seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
    """One micro-batch as ``HFPeftTrainer``'s step takes it (``micro_batches``' elements without the accumulation
    field): tokens, segment_ids, positions int32 [B, T], loss_mask bool [B, T], num_items_in_batch int32 [B]."""
    shapes = {k: jax.ShapeDtypeStruct((rows, seq_len), jnp.bool_ if k == "loss_mask" else jnp.int32)
              for k in BATCH_FIELDS}
    return {**shapes, NUM_ITEMS: jax.ShapeDtypeStruct((rows,), jnp.int32)}


def _placed(graph, mesh):
    """``graph`` (a model or optimizer) with every Variable's value abstract, in the NamedSharding of its
    annotation on ``mesh`` (an axis that does not divide its dimension left out), as the run places them."""

    def one(var):
        value = var.get_value()
        spec = padded(spec_of(var), value.ndim)[: value.ndim]
        spec = tuple(None if a is not None and value.shape[i] % mesh.shape[a] else a for i, a in enumerate(spec))
        sharding = NamedSharding(mesh, PartitionSpec(*spec))
        return var.replace(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding))

    graphdef, state = nnx.split(graph)
    return nnx.merge(graphdef, jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def trace_step(trainer: Any, mesh, rows: int, seq_len: int, *,
               micro_batch: Mapping[str, Any] | None = None) -> Any:
    """``trainer.jitted_train_step()`` traced (flax's ``Traced``) for a micro-batch of ``rows`` x ``seq_len`` tokens
    on ``mesh``: its ``.traced.jaxpr`` (what `product_flops` counts) and ``.lower()`` (`lower_step`).

    trainer: an ``HFPeftTrainer`` (``SFTRun.make_trainer()``, on a loaded or an abstract run). Its model and
    optimizer state enter as shapes in their annotations' shardings, the micro-batch sharded over the trainer's
    ``data_sharding_axis``, as ``train()`` passes them. Traced under ``use_mesh(mesh)``; for a TPU slice's
    compile-only devices (``mesh.tpu.slice_devices``) with Tunix's activation constraints, as on the slice.
    micro_batch: one micro-batch as the trainer takes it, arrays or shapes [rows, seq_len] per field (the first
    element of ``SFTRun.micro_batches``: a ``DPORun``'s carries DPO's fields); default ``micro_batch_shapes``.
    """
    rows_sharding = NamedSharding(mesh, PartitionSpec(*trainer.config.data_sharding_axis))
    layout = micro_batch if micro_batch is not None else micro_batch_shapes(rows, seq_len)
    inputs = {k: jax.ShapeDtypeStruct(np.shape(v), v.dtype, sharding=rows_sharding) for k, v in layout.items()
              if k != ACCUMULATION}  # a check's field, which the trainer drops before the step
    model, optimizer = _placed(trainer.model, mesh), _placed(trainer.optimizer, mesh)
    with use_mesh(mesh), upstream.tunix_shard_on(mesh):
        return trainer.jitted_train_step().trace(model, optimizer, inputs)


def lower_step(trainer: Any, mesh, rows: int, seq_len: int, *,
               micro_batch: Mapping[str, Any] | None = None) -> jax.stages.Lowered:
    """`trace_step` lowered: the program ``train()`` compiles (``tests/plan/test_one_step.py``)."""
    return trace_step(trainer, mesh, rows, seq_len, micro_batch=micro_batch).lower()


def fingerprint(program: str) -> str:
    """The StableHLO of a lowered program (``Lowered.as_text()``, or a ``jax_dump_ir_to`` dump) without debug
    locations, printed as MLIR prints it: equal for equal programs, whatever traced them."""
    from jax._src.interpreters import mlir  # lazy: JAX's internals, for the fingerprint only
    from jax._src.lib.mlir import ir  # lazy: JAX's internals, for the fingerprint only

    with mlir.make_ir_context():
        return ir.Module.parse(program).operation.get_asm(enable_debug_info=False)


@dataclasses.dataclass(frozen=True)
class Compiled:
    """Per-device bytes of the compiled train step (XLA's ``memory_analysis``), its products' FLOPs (counted from
    the traced program, `gemport.plan.flops`: XLA's cost analysis counts a loop's body once) and the executable.

    tokens: the micro-batch's tokens (all devices).
    """

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    products: ProductFlops
    tokens: int
    executable: object

    @classmethod
    def of(cls, executable, tokens: int, products: ProductFlops) -> "Compiled":
        """The figures of ``executable`` (a ``jax.stages.Compiled``) for a micro-batch of ``tokens``, whose
        program's products are ``products`` (`product_flops` of its trace's ``.jaxpr``)."""
        m = executable.memory_analysis()
        return cls(m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes, m.alias_size_in_bytes,
                   products, tokens, executable)

    @property
    def peak_bytes(self) -> int:
        """Arguments + outputs + temporaries, donated buffers counted once."""
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes

    @property
    def flops_per_token(self) -> float:
        """The step's products' FLOPs (the whole mesh's) per token of the micro-batch."""
        return self.products.flops / self.tokens


def compile_step(trainer: Any, mesh, rows: int, seq_len: int, *,
                 micro_batch: Mapping[str, Any] | None = None,
                 compiler_options: Mapping[str, Any] | None = None) -> Compiled:
    """``lower_step`` compiled: what one device holds and computes for a micro-batch of ``rows`` x ``seq_len``
    (``micro_batch``: as ``lower_step``'s). compiler_options: XLA's, as ``Lowered.compile`` takes them (e.g.
    ``{"xla_dump_to": dir, "xla_dump_hlo_as_text": True}`` writes the buffer assignment and memory-usage report)."""
    traced = trace_step(trainer, mesh, rows, seq_len, micro_batch=micro_batch)
    executable = traced.lower().compile(compiler_options)
    return Compiled.of(executable, rows * seq_len, product_flops(traced.traced.jaxpr))


def step_trainer(model: nnx.Module, args: Mapping[str, Any] | None = None, *, loss_fn: LossFn = segment_loss):
    """The ``HFPeftTrainer`` ``SFTRun`` builds for ``model`` and the ``SFTConfig`` fields ``args`` (TRL's defaults
    for the rest; one optimizer step), without data: ``hf_optimizer``'s transformation and schedule, Tunix's
    ``TrainingConfig`` with the recipe's accumulation, no checkpoints."""
    args = sft_fields(dict(args or {}))
    fields = RunFields.from_config(args)
    return HFPeftTrainer(model, hf_optimizer(args, num_training_steps=1).tx, training_config(fields, 1), loss_fn=loss_fn,
                         precision=matmul_precision(fields.bf16, fields.tf32))


def compiled_peak(spec: GemmaSpec, lora_spec: LoraSpec, fsdp: int, tp: int, *, batch: int, seq_len: int,
                  remat: str | None = None, param_dtype="bfloat16", loss_fn: LossFn = segment_loss,
                  qlora: QLoraSpec | None = None, tpu: str | None = None,
                  args: Mapping[str, Any] | None = None) -> int:
    """Per-device peak bytes XLA compiles the train step to on an (fsdp, tp) mesh: of this host's CPU devices, or
    of TPU slice ``tpu``'s chips (e.g. "v5p-8", ``gemport.mesh.tpu.slice_devices``: libtpu's compiler, on this host).

    The step is the one ``SFTRun.train()`` runs (``lower_step`` of ``step_trainer``): ``batch`` rows of
    ``seq_len`` tokens per micro-batch, the optimizer, accumulation, clipping and schedule of the ``SFTConfig``
    fields ``args`` (TRL's defaults for the rest), on an abstract model of ``spec`` with ``lora_spec``; lowered for
    abstract inputs and compiled, never run: nothing is allocated. remat: Tunix's ``remat_config``; default the
    recipe's ``gradient_checkpointing`` (``data.sft.remat_of``: TRL's default is decoder remat). loss_fn: the loss
    of ``HFPeftTrainer(loss_fn=)``. For a TPU slice it is the program the slice would run, splash attention included.
    XLA:CPU computes bfloat16 in float32, so its figure for a bf16 model includes float32 copies of weights
    and activations a TPU would not make: an upper bound for the TPU's. With ``qlora`` the base is 4-bit as
    ``load_qlora_model`` places it (``gemport.run.model.quantize_base``). On CPU, give XLA
    ``CPU_MEMORY_SCHEDULER`` before JAX starts, or remat saves nothing.
    Raises MeshError when the host has fewer than fsdp * tp CPU devices
    (``--xla_force_host_platform_device_count``), or fsdp * tp is not the TPU slice's chip count.
    """
    if tpu is not None:
        devices = slice_devices(tpu)
        if len(devices) != fsdp * tp:
            raise MeshError(f"fsdp={fsdp} tp={tp} is {fsdp * tp} devices; TPU slice {tpu} has {len(devices)} chips")
    else:
        devices = jax.devices("cpu")
        if len(devices) < fsdp * tp:
            raise MeshError(f"compiling for fsdp={fsdp} tp={tp} needs {fsdp * tp} CPU devices, the host has "
                            f"{len(devices)}: set XLA_FLAGS=--xla_force_host_platform_device_count={fsdp * tp}")
    remat = remat if remat is not None else remat_of(dict(args or {}))
    model = lora_model(spec, lora_spec, remat=remat, param_dtype=np.dtype(param_dtype), qlora=qlora)
    mesh = make_mesh(spec, fsdp=fsdp, tp=tp, devices=devices[: fsdp * tp])
    return compile_step(step_trainer(model, args, loss_fn=loss_fn), mesh, batch, seq_len).peak_bytes


__all__ = ["CPU_MEMORY_SCHEDULER", "Compiled", "compile_step", "compiled_peak", "fingerprint", "lower_step",
           "micro_batch_shapes", "step_trainer", "trace_step"]
