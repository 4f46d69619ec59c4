"""One train step: the program gemport plans and compiles is the one ``SFTRun.train()`` compiles.

``SFTRun.train()`` runs ``HFPeftTrainer.jitted_train_step()`` (Tunix's ``nnx.jit`` of the trainer's step: the
recipe's loss, accumulation, clipping, optimizer, schedule, dtype and remat). ``gemport.plan`` lowers that
function for abstract arguments (``plan.compiled.lower_step``), on a run built from ``config.json`` alone
(``SFTRun.create(..., abstract=True)``) or on ``compiled_peak``'s own model and trainer. Here all three are one
program: the StableHLO JAX hands XLA when the run trains (``jax_dump_ir_to``) equals the planned lowerings, debug
locations aside. A change to any of them (another step, loss, optimizer, sharding or remat) fails this test.
"""

import jax
import jax.numpy as jnp
import pytest

from gemport import SFTRun
from gemport.mesh import make_mesh
from gemport.plan import dry_run
from gemport.plan.compiled import compile_step, fingerprint, lower_step, micro_batch_shapes, step_trainer
from gemport.specs import GemmaSpec
from gemport.run.model import lora_model
from gemport.step.fit import FIT
from chats import chats, tokenizer

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "down_proj"]}
# A recipe that exercises every part of the step: accumulation, clipping, decay, a warmed-up cosine schedule.
ARGS = dict(assistant_only_loss=True, packing=True, max_length=64, per_device_train_batch_size=2,
            gradient_accumulation_steps=2, max_steps=1, learning_rate=5e-3, weight_decay=0.1, max_grad_norm=0.5,
            lr_scheduler_type="cosine", warmup_steps=1, seed=3, save_strategy="no", bf16=False)


@pytest.fixture(scope="module")
def runs(hf_checkpoint):
    """``(create, mesh, planned)``: ``create(args, **kwargs)`` builds an ``SFTRun`` of ``args`` on a tiny Gemma 4
    over fsdp=2; ``planned`` is the fingerprint of ``ARGS``' step lowered on the abstract run."""
    _, base = hf_checkpoint("gemma4_mesh")
    mesh = make_mesh(GemmaSpec.from_hf(base), fsdp=2, tp=1, devices=jax.devices()[:2])

    def create(args, **kwargs):
        return SFTRun.create(args, base, chats(12), lora=LORA, tokenizer=tokenizer(), mesh=mesh, progress=False,
                             **kwargs)

    abstract = create(ARGS, abstract=True)
    return create, mesh, _planned(abstract, mesh), abstract


def _planned(run, mesh):
    # As plan.dry_run lowers it: the run's first micro-batch as its trainer takes it (a DPO run's carries its fields).
    first = run.micro_batches(run.train_batches[:1])[0]
    return fingerprint(lower_step(run.make_trainer(), mesh, *first["tokens"].shape, micro_batch=first).as_text())


def _trained(run, tmp_path):
    # The program train() hands XLA: JAX dumps the StableHLO of every jit it lowers.
    jax.config.update("jax_dump_ir_to", str(tmp_path))
    try:
        run.train()
    finally:
        jax.config.update("jax_dump_ir_to", "")
    (dumped,) = tmp_path.glob("*jit_train_step*")
    return fingerprint(dumped.read_text())


def test_planning_lowers_the_program_training_compiles(runs, tmp_path):
    create, mesh, planned, _ = runs
    run = create(ARGS)
    _, rows, seq_len = run.train_batches[0]["tokens"].shape
    # compiled_peak's model and trainer, from the architecture and the recipe's fields
    model = lora_model(run.spec, run.lora_spec, param_dtype=jnp.float32, remat="decoder")
    peak = fingerprint(lower_step(step_trainer(model, ARGS), mesh, rows, seq_len).as_text())
    trained = _trained(run, tmp_path)
    assert "optimization_barrier" in trained  # TRL's default gradient_checkpointing: the tied decoder remat ran
    assert planned == trained
    assert peak == trained


def test_a_run_choosing_its_remat_trains_the_program_its_dry_run_reports(runs, tmp_path):
    """``gradient_checkpointing: true`` on a TPU tries ``step.fit.FIT``: the dry run and the trainer's first step each
    take the first remat XLA compiles (XLA:CPU refuses neither, so both take "projections" here) and the program
    trained is the one the dry run compiled, not decoder remat's."""
    create, mesh, planned, _ = runs
    abstract, run = create(ARGS, abstract=True), create(ARGS)
    abstract.remats = run.remats = FIT  # as SFTRun.create sets them on a TPU mesh
    assert dry_run(abstract).remat == "projections"
    trained = _trained(run, tmp_path)
    assert run.trainer.remat == "projections"
    assert trained == _planned(abstract, mesh) != planned


def test_the_fingerprint_tells_another_step_apart(runs):
    """Without gradient checkpointing the planned program differs (and has no remat barrier): the identity above is
    not one that any step would pass."""
    create, mesh, planned, _ = runs
    other = _planned(create({**ARGS, "gradient_checkpointing": False}, abstract=True), mesh)
    assert other != planned and "optimization_barrier" not in other


def test_the_step_returns_the_model_and_optimizer_in_their_own_buffers(runs):
    """The step donates the model with the optimizer (``HFPeftTrainer.jitted_train_step``): every argument but the
    micro-batch is aliased to an output, so the frozen base is not returned as a second copy, and what the outputs
    hold beyond the aliased state is the loss, its scopes and the gradient norm. With the optimizer alone donated
    (Tunix's ``nnx.jit``) the model's whole state, base included, was returned in new buffers."""
    _, mesh, _, run = runs
    _, rows, seq_len = run.train_batches[0]["tokens"].shape
    compiled = compile_step(run.make_trainer(), mesh, rows, seq_len)
    batch = sum(v.size * v.dtype.itemsize for v in micro_batch_shapes(rows, seq_len).values()) // mesh.shape["fsdp"]
    assert compiled.argument_bytes - compiled.alias_bytes == batch
    # loss float32 [], masked_loss and full_sequence_loss float32 [2], grad_norm float32 []: 24 bytes; and XLA's
    # table of the outputs' addresses, 8 bytes an output.
    outputs = compiled.executable.out_tree.num_leaves
    assert compiled.output_bytes - compiled.alias_bytes == 24 + 8 * outputs, (compiled, outputs)


def test_dpo_planning_lowers_the_program_dpo_training_compiles(runs, hf_checkpoint, tmp_path):
    """``gemport dpo --dry-run``'s step is ``DPORun.train()``'s: chosen and rejected rows of the longest pair, the
    reference pass with LoRA off, DPO's loss and metrics, TRL's defaults for the rest (gradient checkpointing)."""
    from gemport.run import DPORun
    from preference_records import RECORDS

    _, mesh, sft_planned, _ = runs
    args = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=1, learning_rate=5e-3,
                max_grad_norm=0.5, beta=0.2, seed=3, save_strategy="no", bf16=False)
    _, base = hf_checkpoint("gemma4_mesh")

    plain = tokenizer()
    plain.eos_token = "<turn|>"  # ends plain completions, as TRL appends the tokenizer's eos

    def create(**kwargs):
        return DPORun.create(args, base, RECORDS["explicit"], lora=LORA, tokenizer=plain,
                             mesh=mesh, progress=False, **kwargs)

    abstract = create(abstract=True)
    assert abstract.train_batches[0]["tokens"].shape[:2] == (2, 4)  # A micro-batches of [chosen; rejected] x 2
    planned = _planned(abstract, mesh)
    trained = _trained(create(), tmp_path)
    assert "optimization_barrier" in trained
    assert planned == trained != sft_planned
