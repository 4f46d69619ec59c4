"""Tunix's PeftTrainer.train() driven by gemport: HF-equal accumulation, both loss scopes, eval, exports.

A few optimizer steps on tiny random Gemma 4 (31B layout) and Gemma 3 (1B), on one device and on a 2-device
mesh; the per-step loss equals gemport.step's HF-semantics ``train_step`` on the same batches, and the
trained adapter, exported merged and as PEFT, gives transformers the Tunix model's logits.
"""

import contextlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from tunix.sft.peft_trainer import TrainingConfig

from gemport.data import optimizer_steps, pack, pad, stack

from gemport.step import train_step, tunix_loss
from gemport.checkpoint import export_merged, export_peft, load_model, load_lora
from gemport.errors import BatchError
from gemport.lora import LoraSpec, apply_lora
from gemport.mesh import make_mesh
from gemport.optim import hf_optimizer
from gemport.specs import GemmaSpec
from gemport.run.trainer import NUM_ITEMS, HFPeftTrainer, micro_batches
from gemport.check.verify import compare_logits

SEQ = 12
STEPS = 3
ARGS = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=STEPS, learning_rate=5e-3,
            weight_decay=0.1, max_grad_norm=0.5, lr_scheduler_type="cosine", warmup_steps=1, seed=7,
            # Adam moves an element with a near-zero gradient by ~lr on fp32 noise alone (lr * sign(g)); a larger
            # epsilon keeps such elements still, so the trained LoRA params of two implementations compare at 1e-5.
            adam_epsilon=1e-3)
PEFT_CONFIG = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
               "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


def examples(vocab, n, seed):
    """n (tokens, loss_mask) pairs of 4..SEQ tokens, of which a random tail is trained (assistant-like)."""
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(n):
        length = int(rng.integers(4, SEQ + 1))
        tokens = rng.integers(1, vocab, length).astype(np.int32)
        mask = np.zeros(length, bool)
        mask[int(rng.integers(1, length)):] = True
        pairs.append((tokens, mask))
    return pairs


def step_batches(vocab):
    """HF-ordered [A, B, SEQ] batches of packed rows (targets unequal across micro-batches), and an eval split."""
    rows = pack(examples(vocab, 20, seed=1), SEQ)
    steps = [stack([{k: v[m] for k, v in rows.items()} for m in s.micro_batches],
                         accumulation=ARGS["gradient_accumulation_steps"], rows=ARGS["per_device_train_batch_size"])
             for s in optimizer_steps(ARGS, len(rows["tokens"]))]
    held_out = pad(examples(vocab, 4, seed=2), SEQ)
    evals = [{k: v[None, i:i + 2] for k, v in held_out.items()} for i in (0, 2)]
    return steps, evals


@contextlib.contextmanager
def on_mesh(mesh):
    """``mesh`` as both the current mesh and the physical mesh PeftTrainer shards its inputs on (JAX 0.10)."""
    if mesh is None:
        yield
        return
    with jax.set_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # `with mesh:` is PeftTrainer's way to find it
        with mesh:
            yield


def lora_model(hf_dir, spec, lora_spec, mesh):
    model = load_model(hf_dir, mesh=mesh, param_dtype=jnp.float32)
    return apply_lora(model, spec, lora_spec, seed=3)


# Gemma 4 on one device, Gemma 3 on a 2-device fsdp mesh (why 2 devices: docs/train.md, "On a simulated mesh").
# Gemma 4 with TRL's default LoRA dropout: both trainers draw the same masks from the seed and the micro-batch
# count, and evaluation (compared with the model called outside a training step) has none.
@pytest.mark.parametrize("name, mesh_shape, dropout", [("gemma4_dense", None, 0.05), ("gemma3_1b", (2, 1), 0.0)])
def test_peft_trainer_takes_hf_steps(hf_checkpoint, tmp_path, name, mesh_shape, dropout):
    _, hf_dir = hf_checkpoint(name)
    spec = GemmaSpec.from_hf(hf_dir)
    lora_spec = LoraSpec.from_peft({**PEFT_CONFIG, "lora_dropout": dropout})
    steps, evals = step_batches(spec.vocab)
    mesh = None if mesh_shape is None else make_mesh(spec, fsdp=mesh_shape[0], tp=mesh_shape[1],
                                                    devices=jax.devices()[:2])
    root = tmp_path / "checkpoints"
    config = TrainingConfig(
        eval_every_n_steps=STEPS, max_steps=STEPS, gradient_accumulation_steps=ARGS["gradient_accumulation_steps"],
        checkpoint_root_directory=str(root), max_inflight_computations=1, pbar_description=None,
        checkpointing_options=ocp.CheckpointManagerOptions(save_interval_steps=1, max_to_keep=1),
    )
    hf = hf_optimizer(ARGS, num_training_steps=STEPS)

    with on_mesh(mesh):
        model = lora_model(hf_dir, spec, lora_spec, mesh)
        # The same step-0 model, trained below by step.train_step, in arrays of its own: the trainer's step donates
        # the model's (a clone would share them).
        graphdef, state = nnx.split(model)
        reference = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))
        trainer = HFPeftTrainer(model, hf.tx, config, lora_spec=lora_spec, seed=ARGS["seed"])
        trainer.train(micro_batches(steps), micro_batches(evals))
        logger = trainer.metrics_logger
        losses = logger.get_metric_history("", "loss", "train")
        grad_norms = logger.get_metric_history("", "grad_norm", "train")
        masked = logger.get_metric_history("", "masked_loss", "train")
        full = logger.get_metric_history("", "full_sequence_loss", "train")
        eval_losses = logger.get_metric_history("", "loss", "eval")
        eval_full = logger.get_metric_history("", "full_sequence_loss", "eval")

        optimizer = nnx.Optimizer(reference, hf.tx, wrt=nnx.LoRAParam)
        step = train_step(wrt=nnx.LoRAParam, seed=ARGS["seed"])
        expected = [step(reference, optimizer, batch) for batch in steps[:STEPS]]
        expected_eval = []
        for batch in evals:
            summed, count = tunix_loss(reference, {k: v[0] for k, v in batch.items()})
            expected_eval.append(float(summed / count))

    assert len(losses) == STEPS
    np.testing.assert_allclose(losses, [float(m.loss) for m in expected], rtol=0, atol=1e-5)
    np.testing.assert_allclose(grad_norms, [float(m.grad_norm) for m in expected], rtol=1e-5, atol=0)
    np.testing.assert_allclose(masked, losses, rtol=0, atol=1e-5)  # the trained scope is the loss
    assert np.all(full != masked) and np.all(np.isfinite(full))
    assert len(eval_losses) == 2 and len(eval_full) == 2  # before training and after the last step
    np.testing.assert_allclose(eval_losses[1], np.mean(expected_eval), rtol=0, atol=1e-5)
    trained = nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))
    moved = [np.abs(np.asarray(v.get_value())).max() > 1e-4 for path, v in trained if "lora_b" in str(path[-1])]
    assert moved and all(moved)  # every B factor left PEFT's zero init
    for (path, a), (_, b) in zip(trained, nnx.to_flat_state(nnx.state(reference, nnx.LoRAParam)), strict=True):
        np.testing.assert_allclose(np.asarray(a.get_value()), np.asarray(b.get_value()), rtol=0, atol=1e-5,
                                   err_msg=str(path))

    assert load_lora(root).lora_spec == lora_spec
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    export_merged(root, merged, base_dir=hf_dir)
    export_peft(root, adapter, base_dir=hf_dir)
    for report in (compare_logits(merged, model, seq_len=SEQ), compare_logits(hf_dir, model, adapter_dir=adapter,
                                                                             seq_len=SEQ)):
        assert report.ok, report


def test_micro_batches_carry_the_step_target_count():
    steps, _ = step_batches(96)
    data = micro_batches(steps)
    assert len(data) == 2 * len(steps)
    for s, batch in enumerate(steps):
        count = int(batch["loss_mask"][:, :, 1:].sum())
        for a in range(2):
            element = data[2 * s + a]
            np.testing.assert_array_equal(element["tokens"], batch["tokens"][a])
            assert element[NUM_ITEMS].tolist() == [count, count]
    with pytest.raises(BatchError, match=r"\[A, B, T\]"):
        micro_batches([steps[0], {k: v[0] for k, v in steps[1].items()}])

