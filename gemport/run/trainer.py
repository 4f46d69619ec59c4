"""Tunix's ``PeftTrainer`` taking HF Trainer steps: token-weighted accumulation, both loss scopes, exact resume.

``PeftTrainer`` accumulates ``gradient_accumulation_steps`` micro-batches with ``optax.MultiSteps``, which
averages each micro-batch's gradient with equal weight, and it never tells the loss how many targets the
whole accumulated batch has. HF's Trainer divides every micro-batch's *summed* token loss by the targets
of all of them (``num_items_in_batch``). The two agree when each micro-batch carries that count and its
loss is ``A * summed / num_items_in_batch`` (A micro-batches a step): the mean MultiSteps takes is then
``sum of summed losses / num_items_in_batch``, HF's gradient, and the mean of the A logged losses is HF's
logged loss. ``micro_batches`` lays the data out that way; ``HFPeftTrainer`` sets the matching loss.

On restart ``PeftTrainer`` restores the latest Orbax checkpoint (LoRA params, optimizer state with the
schedule's count) and skips as many micro-batches as it had consumed; over a Grain ``MapDataset``, which
yields the same elements in the same order on every pass, it continues exactly where it stopped. ``HFPeftTrainer``
first reads the newest checkpoint back whole and sets aside any that does not (``checkpoint.integrity``), so it
resumes from the newest intact one.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.interpreters import pxla
from jax.sharding import NamedSharding, PartitionSpec

from gemport.checkpoint.adapters import save_lora_spec
from gemport.checkpoint.integrity import resume_step, steps
from gemport.errors import BatchError, CheckpointError, TrainingError
from gemport._src import upstream
from gemport._src.extras import require
from gemport.lora import LoraSpec, dropout_key, lora_dropout
from gemport.step.cross_entropy import nll_scopes
from gemport.step.attention import check_segments
from gemport.step.fit import described, does_not_fit, first_fitting, refused
from gemport.data.distributed import global_batch
from gemport.run.preemption import Preemption
from gemport.step.hf import LossFn, per_target, segment_loss
from gemport.step.precision import Precision, with_precision
from gemport.data.batching import BATCH_FIELDS
from gemport.data.steps import StepBatches
from gemport.data.stream import StreamBatches

grain = require("grain", "gemport.run.trainer")
peft_trainer = require("tunix.sft.peft_trainer", "gemport.run.trainer")

NUM_ITEMS = "num_items_in_batch"
"""The field every micro-batch carries: its optimizer step's target count, int32 [B] (one per row, so it
shards with the rows)."""

ACCUMULATION = "gradient_accumulation_steps"
"""The field every micro-batch carries: the A its steps were laid out for, int32 [B]. ``HFPeftTrainer`` refuses a
training micro-batch whose A is not its ``TrainingConfig.gradient_accumulation_steps`` (the loss weighting would
be wrong) and removes the field before the step."""

SCOPES = ("masked_loss", "full_sequence_loss")
"""The loss scopes ``HFPeftTrainer`` logs beside ``loss``, train and eval (``step.loss_scopes``): the
targets of ``loss_mask`` (assistant-only under the default policy) and every token of its own segment."""

EXAMPLE_LOSS = "example_loss"
"""The eval metric that is HF's ``eval_loss``: each eval batch's loss weighted by its examples, float32 [2] =
[loss x examples, examples] per batch. HF repeats a batch's loss once per example and drops a short last batch's
padding as it gathers them, so a short last batch weighs its examples only (Tunix's own eval ``loss`` is the
plain mean over batches)."""


def final_evaluation(step: int, eval_every: int | None, max_steps: int | None) -> bool:
    """Whether HF evaluates after ``step`` beyond every ``eval_every`` steps: after the last step (``max_steps``)
    when evaluation is on (``eval_every`` at most ``max_steps``, ``run.sft.training_config``'s) and that step
    is not a multiple of ``eval_every``, as transformers' ``DefaultFlowCallback`` does."""
    return (None not in (eval_every, max_steps) and step == max_steps and eval_every <= max_steps
            and max_steps % eval_every != 0)


def examples_in(segment_ids: jax.Array) -> jax.Array:
    """The rows of a batch [B, T] that hold an example (any token of a segment), float32 []."""
    return jnp.sum(jnp.any(segment_ids > 0, axis=-1)).astype(jnp.float32)


def micro_batches(steps: Sequence[Mapping[str, np.ndarray]] | StepBatches | StreamBatches, *,
                  skip: int = 0) -> grain.MapDataset:
    """A Grain ``MapDataset`` of PeftTrainer's micro-batches from optimizer steps' batches.

    Under ``jax.distributed``, give each process the rows it holds (``data.distributed.process_step``),
    every process the same steps: the step's targets are then summed over processes, and PeftTrainer
    assembles each micro-batch's global [B, T] from the processes' rows.

    Args:
      steps: the batches of successive optimizer steps, each mapping ``BATCH_FIELDS`` to arrays [A, B, T]
        (``step.stack``, or ``SFTPipeline.batches``' second items), all of one shape; other keys are dropped. A
        ``data.StepBatches`` (or a stream's ``data.StreamBatches``) is read lazily: each micro-batch is built when
        the dataset is read (Grain's ``__getitem__``), its step's targets counted over every process's rows (no
        collective); a list is read once (its targets summed over processes: one collective, here).
      skip: the first ``skip`` elements are empty dicts, not built: those a resumed ``PeftTrainer`` passes over
        (it iterates past the micro-batches its checkpoint consumed, ``train_steps * A``, without using them).

    Returns:
      A ``grain.MapDataset`` of ``len(steps) * A`` elements: element ``s * A + a`` is micro-batch ``a`` of step
      ``s``, a dict of ``BATCH_FIELDS`` [B, T], ``NUM_ITEMS`` int32 [B] (the targets of the whole step, the
      same in every row) and ``ACCUMULATION`` int32 [B] (A). Give ``PeftTrainer``
      ``gradient_accumulation_steps=A``. A held-out split laid out as steps of A = 1 is an eval dataset.

    Raises:
      BatchError: no step, or step batches not all [A, B, T] of one shape.

    Example:

      >>> import numpy as np
      >>> from gemport import micro_batches
      >>> A, B, T = 2, 3, 8
      >>> step = {"tokens": np.ones((A, B, T), np.int32), "loss_mask": np.ones((A, B, T), bool),
      ...         "segment_ids": np.ones((A, B, T), np.int32), "positions": np.broadcast_to(np.arange(T), (A, B, T))}
      >>> data = micro_batches([step, step])
      >>> len(data), data[0]["tokens"].shape  # 2 steps of 2 micro-batches of [B, T]
      (4, (3, 8))
      >>> data[0]["num_items_in_batch"], data[0]["gradient_accumulation_steps"]  # the step's A * B * (T - 1) targets
      (array([42, 42, 42], dtype=int32), array([2, 2, 2], dtype=int32))
    """
    if not len(steps):
        raise BatchError("micro_batches: no optimizer step")
    if isinstance(steps, (StepBatches, StreamBatches)):
        (accumulation, rows, _), micro, targets = steps.shape, steps.micro, steps.targets
    else:
        (accumulation, rows, _), micro, targets = _laid_out(steps)

    def element(index):
        if index < skip:
            return {}
        s, a = divmod(index, accumulation)
        out = dict(micro(s, a))
        out[NUM_ITEMS] = np.full(rows, targets(s), np.int32)
        out[ACCUMULATION] = np.full(rows, accumulation, np.int32)
        return out

    return grain.MapDataset.range(len(steps) * accumulation).map(element)


def _laid_out(steps):
    # Batches laid out ahead: their one shape, each micro-batch a view, each step's targets over every process.
    steps = [{k: np.asarray(batch[k]) for k in BATCH_FIELDS} for batch in steps]
    shapes = {batch["tokens"].shape for batch in steps}
    if len(shapes) != 1 or len(next(iter(shapes))) != 3:
        raise BatchError(
            f"micro_batches: step batches must all be [A, B, T]; got shapes {sorted(shapes)} (step.stack them "
            "with one accumulation and rows)"
        )
    counts = np.array([batch["loss_mask"][:, :, 1:].sum() for batch in steps], np.int64)
    if jax.process_count() > 1:
        counts = multihost_utils.process_allgather(counts).sum(axis=0)
    counts = counts.tolist()
    return next(iter(shapes)), lambda s, a: {k: steps[s][k][a] for k in BATCH_FIELDS}, counts.__getitem__


def prefetched(dataset: grain.MapDataset, elements: int) -> grain.IterDataset:
    """``dataset`` read in order by one thread ahead of the trainer, holding at most ``elements`` built elements:
    the next step's micro-batches are built while the device runs this one, and no more are held (Grain's own
    reading of a ``MapDataset`` keeps 500 ahead on 16 threads)."""
    return dataset.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=elements))


def _scoped(model, tokens, loss_mask, segment_ids, positions, loss_fn):
    # Each scope as [summed loss, targets], so micro-batches and eval batches combine weighted by targets.
    batch = dict(tokens=tokens, loss_mask=loss_mask, segment_ids=segment_ids, positions=positions)
    scopes = nll_scopes(per_target(loss_fn)(model, batch), loss_mask, segment_ids)
    return {
        "masked_loss": jnp.stack([scopes["masked"] * scopes["masked_targets"], scopes["masked_targets"]]),
        "full_sequence_loss": jnp.stack(
            [scopes["full_sequence"] * scopes["full_sequence_targets"], scopes["full_sequence_targets"]]),
    }


def hf_loss(accumulation: int, *,
            loss_fn: LossFn = segment_loss) -> Callable[..., tuple[jax.Array, dict[str, jax.Array]]]:
    """PeftTrainer's ``loss_fn`` (with ``has_aux=True``) for steps of ``accumulation`` (A) micro-batches.

    loss_fn: the step's loss, ``step.segment_loss`` (segment attention, chunked cross-entropy; the default) or
    ``step.tunix_loss`` (Tunix's own attention and logits): the same loss.

    Returns ``loss(model, tokens, loss_mask, segment_ids, positions, num_items_in_batch)``: tokens,
    loss_mask, segment_ids, positions [B, T], as ``data.pack`` / ``pad`` lay them out; num_items_in_batch
    int32 [B], the step's targets (``micro_batches``). It returns (``A * summed target loss /
    num_items_in_batch`` float32 [], this micro-batch's share of HF's loss; the scopes of ``SCOPES``, each
    float32 [2] = [summed loss, targets]).
    """

    # Named parameters, not a partial: nnx.value_and_grad binds the batch's keywords to positions.
    def loss(model: nnx.Module, tokens: jax.Array, loss_mask: jax.Array, segment_ids: jax.Array, positions: jax.Array,
             num_items_in_batch: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        scopes = _scoped(model, tokens, loss_mask, segment_ids, positions, loss_fn)
        total = jnp.maximum(jnp.max(num_items_in_batch), 1).astype(jnp.float32)
        return scopes["masked_loss"][0] * accumulation / total, scopes

    return loss


def eval_loss(model: nnx.Module, tokens: jax.Array, loss_mask: jax.Array, segment_ids: jax.Array, positions: jax.Array,
              loss_fn: LossFn = segment_loss, **_: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """An eval batch's mean target loss (HF's per-batch loss) and the scopes of ``SCOPES``, with
    ``EXAMPLE_LOSS`` [that loss x the batch's examples, examples]; ``loss_fn`` as ``hf_loss``'s."""
    scopes = _scoped(model, tokens, loss_mask, segment_ids, positions, loss_fn)
    masked = scopes["masked_loss"]
    value = masked[0] / jnp.maximum(masked[1], 1)
    examples = examples_in(segment_ids)
    return value, {**scopes, EXAMPLE_LOSS: jnp.stack([value * examples, examples])}


def _last(values):
    return np.float32(values[-1])


def _ratio(values):
    summed = np.asarray(values, np.float64).reshape(-1, 2).sum(axis=0)
    return np.float32(summed[0] / max(summed[1], 1))


class _Checkpoints:
    """Tunix's ``CheckpointManager`` whose failed writes (a full disk, a lost mount, a quota) are a
    ``CheckpointError`` naming the root, the step and what is kept. Orbax writes each checkpoint in a temporary
    directory and renames it when complete, so a failed or interrupted save leaves no step that looks complete,
    and deletes older ones (``save_total_limit``) only after that rename."""

    def __init__(self, manager: Any, root: str) -> None:
        self._manager, self._root = manager, root

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)

    def _failed(self, step: int | None, error: Exception) -> CheckpointError:
        kept = steps(self._root)
        # Orbax reports an asynchronous write's failure at the next save: its unfinished directory names the step.
        root = Path(self._root)
        unfinished = sorted(int(p.name.split(".")[0]) for p in root.glob("*.orbax-checkpoint-tmp*")
                            if p.name.split(".")[0].isdigit()) if root.is_dir() else []
        failed = unfinished[-1] if unfinished else step
        return CheckpointError(
            f"{self._root}: writing a checkpoint failed{'' if failed is None else f' (step {failed})'}: "
            f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}; the disk may be "
            f"full or the location no longer writable. Checkpoints kept: {kept or 'none'}; free space (or give an "
            "output_dir with room) and run the same command again to resume from the newest")

    def save(self, step: int, *args: Any, **kwargs: Any) -> bool:
        try:
            return self._manager.save(step, *args, **kwargs)
        except Exception as e:  # Orbax and TensorStore raise ValueError, OSError, RuntimeError for a failed write
            raise self._failed(step, e) from e

    def close(self) -> None:
        try:
            self._manager.close()  # waits for the last asynchronous write
        except Exception as e:
            raise self._failed(None, e) from e


class HFPeftTrainer(upstream.peft_trainer_class()):
    """``tunix.sft.PeftTrainer`` whose gradient accumulation is HF's and whose metrics have both loss scopes.

    Train on ``micro_batches(...)`` (``trainer.train(train_ds, eval_ds)``); the loss is ``hf_loss``, the eval
    loss ``eval_loss``, and ``masked_loss`` / ``full_sequence_loss`` are logged beside ``loss``
    (``metrics_logger``, modes ``"train"`` and ``"eval"``). The logged ``loss`` and ``grad_norm`` (before
    clipping) per step are HF's. A step whose loss or gradient norm is not finite stops the run before it is
    checkpointed (``TrainingError``). With a ``checkpoint_root_directory`` the trainer resumes from its newest
    intact checkpoint.

    Args:
      model: a Tunix Gemma with LoRA (``lora.apply_lora``) or without (full fine-tune).
      optimizer: ``optim.hf_optimizer(args, num_training_steps=...).tx`` (accumulation is the trainer's:
        ``training_config.gradient_accumulation_steps``).
      training_config: ``tunix.sft.peft_trainer.TrainingConfig``.
      lora_spec: recorded beside the checkpoints (``checkpoint.save_lora_spec``) when
        ``checkpoint_root_directory`` is set, so exports find it.
      preemption: a ``run.preemption.Preemption``: on SIGTERM the trainer writes its metrics and the
        checkpoint of the step it reaches (on every process, the same step), closes, and raises ``Preempted``;
        ``train()`` again resumes from that checkpoint.
      loss_fn: ``hf_loss``'s: ``step.segment_loss`` (segment attention and chunked cross-entropy, the default),
        or ``step.tunix_loss``, Tunix's own attention and logits, which refuses packed rows to a model built
        with ``use_flash_attention``.
      precision: the precision of the step's products (``step.precision.matmul_precision`` of the recipe:
        ``"highest"`` for a float32 recipe, ``"default"`` for a bfloat16 one); the train and eval steps are
        traced under it (``step.precision.with_precision``).
      remats: the remats the first step tries, in order (``step.fit.fit_remats``): the step trains under the first
        one XLA compiles within the devices' memory (``step.fit.first_fitting``); the trainer's ``remat`` is the
        one taken, printed by process 0. Empty: the model's remat, as set.
      seed: the LoRA dropout stream's (HF's ``seed``). With ``model.lora_spec.dropout`` above 0 the ``i``-th
        micro-batch trained (counted by ``optimizer.step``, which checkpoints carry) runs under
        ``lora.lora_dropout(model, lora.dropout_key(seed, i))``: a resume draws the masks an uninterrupted run
        draws. Evaluation runs without dropout, as HF's in eval mode.
      **kwargs: ``PeftTrainer``'s other arguments (``metrics_logger``, ...).
    """

    LOGGED: tuple[str, ...] = SCOPES
    """The metrics ``run.outputs.HFOutputs`` logs beside ``loss``, ``grad_norm`` and ``learning_rate``."""

    def __init__(self, model: nnx.Module, optimizer: optax.GradientTransformation,
                 training_config: peft_trainer.TrainingConfig, *, lora_spec: LoraSpec | None = None,
                 preemption: Preemption | None = None, loss_fn: LossFn = segment_loss, seed: int = 0,
                 precision: Precision = "default", remats: Sequence[str] = (), **kwargs: Any) -> None:
        if training_config.checkpoint_root_directory is not None:  # Tunix resumes from the newest step dir
            resume_step(training_config.checkpoint_root_directory)
        super().__init__(model, optimizer, training_config, **kwargs)
        if training_config.checkpoint_root_directory is not None:
            self.checkpoint_manager = _Checkpoints(self.checkpoint_manager, training_config.checkpoint_root_directory)
        self._preemption = preemption
        self._seed = seed
        self.precision = precision
        self.remats = tuple(remats)
        self.remat = getattr(model, "remat", None)  # the model's (step.remat.set_remat), until the first step picks
        accumulation = training_config.get_with_default("gradient_accumulation_steps", 1)
        per_target(loss_fn)  # refuses a loss without per-target scopes before anything is traced
        self.step_loss = loss_fn
        self.with_loss_fn(hf_loss(accumulation, loss_fn=loss_fn), has_aux=True)
        self.eval_loss_fn = functools.partial(eval_loss, loss_fn=loss_fn)
        if lora_spec is not None and training_config.checkpoint_root_directory is not None:
            save_lora_spec(training_config.checkpoint_root_directory, lora_spec)

    def create_train_step_fn(self) -> Callable[..., Any]:
        """PeftTrainer's step, with ``grad_norm`` the norm of the gradient accumulated up to this micro-batch.

        MultiSteps keeps the running mean of the micro-batches' gradients; with the step's last micro-batch it
        is HF's gradient, whose norm (before clipping) is what HF logs as ``grad_norm``.
        """

        def train_step(model, optimizer, inputs):
            grad_fn = nnx.value_and_grad(self.loss_fn, argnums=nnx.DiffState(0, optimizer.wrt), has_aux=True)
            # Tunix updates the optimizer once per micro-batch: its step counts them.
            with lora_dropout(model, dropout_key(self._seed, optimizer.step[...].astype(jnp.int32))):
                (loss, aux), grads = grad_fn(model, **self.gen_model_input_fn(inputs))
            accumulated = nnx.as_pure(nnx.state(grads, optimizer.wrt))
            state = nnx.as_pure(optimizer.opt_state)
            if isinstance(state, optax.MultiStepsState):
                accumulated = jax.tree.map(lambda g, mean: mean + (g - mean) / (state.mini_step + 1),
                                           accumulated, state.acc_grads)
            grad_norm = optax.tree.norm(accumulated)
            optimizer.update(model, grads)
            return loss, aux, grad_norm

        return with_precision(train_step, self.precision)

    def create_eval_step_fn(self) -> Callable[..., Any]:
        """PeftTrainer's eval step, traced at the trainer's ``precision``."""
        return with_precision(super().create_eval_step_fn(), self.precision)

    def jitted_train_step(self) -> Any:
        """The train step ``train()`` runs: ``nnx.jit`` of ``create_train_step_fn`` with the model and the optimizer
        donated, ``step(model, optimizer, inputs) -> (loss, aux, grad_norm)``, with ``inputs`` a micro-batch of
        ``micro_batches`` without ``ACCUMULATION``. Its ``.lower(...)`` on abstract arguments is what
        ``gemport.plan`` compiles; ``tests/plan/test_one_step.py`` holds it to the program ``train()`` lowers.

        ``nnx.jit`` returns the model's whole state, the frozen base included; Tunix donates only the optimizer,
        so every step would write the base into new buffers, a second copy of it at the step's peak. Donated,
        the outputs alias the inputs. Nothing reads the replaced arrays between steps: Orbax's save (checkpoints,
        preemption, ``close``) copies every array to the host before it returns (Tunix's handlers set no
        device-to-host byte limit, so no transfer is deferred), and eval and exports read the model's current
        arrays. Arrays of the model held elsewhere before ``train()`` (``nnx.state(model)`` kept aside) are
        deleted by the first step.
        """
        return nnx.jit(self.create_train_step_fn(), donate_argnames=("model", "optimizer"))

    def first_train_step(self, bind: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
        """The ``step(inputs)`` ``train()`` calls: ``bind()`` (``jitted_train_step()`` bound to the model and the
        optimizer), whose first call, with ``remats`` to choose from, sets each in turn until XLA compiles the step
        (``step.fit.first_fitting``; a refused compile runs nothing, so nothing donated is lost). A step XLA
        refuses under the last remat raises BatchError (``step.fit.does_not_fit``: the micro-batch, the mesh,
        XLA's finding and what to change) rather than XLA's own error."""
        trainer = self

        class First:
            def __init__(self):
                self.step, self.chosen = bind(), False

            def __call__(self, inputs):
                if self.chosen:
                    return self.step(inputs)

                def attempt():
                    self.step = bind()
                    return self.step(inputs)

                try:
                    if len(trainer.remats) < 2:
                        out, refusals = self.step(inputs), None
                    else:
                        out, trainer.remat, refusals = first_fitting(trainer.model, trainer.remats, attempt)
                except Exception as e:
                    if not refused(e):
                        raise
                    mesh = pxla.thread_resources.env.physical_mesh
                    remat = getattr(trainer.model, "remat", trainer.remat)
                    raise does_not_fit(e, remat, *np.shape(inputs["tokens"])[-2:],
                                       {} if mesh.empty else dict(mesh.shape)) from None
                self.chosen = True
                if refusals is not None and jax.process_index() == 0:
                    why = described(trainer.remat, trainer.remats, refusals)
                    print(f"gemport: the step trains under remat {trainer.remat} ({why})", flush=True)
                return out

            @property
            def jitted_fn(self):  # Tunix reads its compile cache's size
                step = self.step
                return (step.func if isinstance(step, functools.partial) else step).jitted_fn

        return First()

    def prepare_inputs(self, input_data: Any, training: bool) -> Any:
        """Refuses packed rows to a segment-blind attention (with ``step.tunix_loss``) and a training micro-batch
        laid out for another accumulation than the config's, and drops that field; under ``jax.distributed``,
        each field's global array from this process's rows, sharded over ``data_sharding_axis``. (Tunix 0.1.7
        checks the axis divides the *local* rows and otherwise treats each process's rows as the whole replicated
        batch, which silently trains on other data.)"""
        if self.step_loss is not segment_loss:
            check_segments(self.model, input_data["segment_ids"], "HFPeftTrainer")
        given = input_data.pop(ACCUMULATION, None)
        expected = self.config.get_with_default("gradient_accumulation_steps", 1)
        laid_out = None if given is None else int(np.asarray(given).flat[0])
        if training and laid_out not in (None, expected):
            raise BatchError(
                f"HFPeftTrainer: the batches were laid out for gradient_accumulation_steps={laid_out} but "
                f"TrainingConfig.gradient_accumulation_steps={expected}; build both from one SFTConfig "
                "(gemport.SFTRun), or give micro_batches(...) steps of that many micro-batches"
            )
        mesh = pxla.thread_resources.env.physical_mesh
        if jax.process_count() == 1 or mesh.empty:
            return input_data
        sharding = NamedSharding(mesh, PartitionSpec(*self.config.data_sharding_axis))
        return global_batch(input_data, sharding, None, axis=0)

    def after_step(self, step: int) -> None:
        # Called once per optimizer step, after its metrics are written and before PeftTrainer's periodic checkpoint.
        if self._preemption is not None:
            self._preemption.check(step, self._stop, where=str(self.config.checkpoint_root_directory))
        if final_evaluation(step, self.config.eval_every_n_steps, self.config.max_steps):
            self.evaluate()

    def check_step(self, buffer) -> None:
        """Refuses the step just taken when its loss or gradient norm is not finite, before it is checkpointed.

        HF's Trainer logs such a step (``logging_nan_inf_filter`` only hides it from the logged mean) and goes
        on with the weights the non-finite gradient made: a run that ends normally with a useless adapter. Here
        the run stops at that step, its checkpoint unwritten, the older ones kept.
        """
        loss = np.array([np.asarray(v, np.float32) for v in buffer.losses])  # replicated scalars, on every process
        grad_norm = np.asarray(buffer.additional_metrics["grad_norm"][0][-1], np.float32)
        if np.isfinite(loss).all() and np.isfinite(grad_norm):
            return
        root = self.config.checkpoint_root_directory
        last = self.checkpoint_manager.latest_step()
        self.checkpoint_manager.close()  # waits for a checkpoint still being written
        raise TrainingError(
            f"step {self.train_steps}: the loss is {loss.tolist()} (per micro-batch) and the gradient norm "
            f"{float(grad_norm)}; the weights this step made are not finite, so the run stops before "
            "checkpointing them ("
            + (f"the last checkpoint, step {last} in {root}, is kept" if last is not None else "no checkpoint")
            + "); lower learning_rate or set max_grad_norm, or look for an empty or extreme example in this "
            "step's data, then run again to resume"
        )

    def _stop(self):
        self._preemption = None  # close() writes the metrics again
        self.close()  # the last step's metrics, its checkpoint (waited for), the logger

    def post_train_step(self, buffer, aux):
        values, _ = buffer.additional_metrics["grad_norm"]
        buffer.additional_metrics["grad_norm"] = (values, _last)
        self._buffer_ratios(buffer, aux, self.LOGGED)

    def post_eval_step(self, buffer, aux):
        self._buffer_ratios(buffer, aux, (*self.LOGGED, EXAMPLE_LOSS))

    @staticmethod
    def _buffer_ratios(buffer, aux, names):
        # Each [sum, weight] of aux, summed over the step's micro-batches (or the eval batches) before dividing.
        for name in names:
            values, _ = buffer.additional_metrics.setdefault(name, ([], _ratio))
            values.append(aux[name])


__all__ = [
    "ACCUMULATION",
    "EXAMPLE_LOSS",
    "NUM_ITEMS",
    "SCOPES",
    "HFPeftTrainer",
    "eval_loss",
    "examples_in",
    "final_evaluation",
    "hf_loss",
    "micro_batches",
    "prefetched",
]
