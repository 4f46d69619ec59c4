"""What HF's Trainer leaves in ``output_dir`` while it trains: ``trainer_state.json``, its trackers' logs, a bar.

``HFOutputs`` is a Tunix ``TrainingHooks`` for an ``SFTRun``'s trainer. At every logging step it appends HF's
``log_history`` entry (``loss``: the mean of the steps since the last entry; ``grad_norm`` before clipping;
``learning_rate``: the step's; ``epoch``; ``step``; and gemport's two loss scopes, ``masked_loss`` and
``full_sequence_loss``) and rewrites ``trainer_state.json`` atomically; after each evaluation at ``eval_steps``
it appends ``eval_loss`` and the scopes as ``eval_*``. Every entry also goes to the trackers of ``report_to``
(``gemport.run.trackers``: TensorBoard, W&B, trackio) under HF's names. On a resumed run it keeps the entries
up to the restored step, so the file reads as an uninterrupted run's. Under ``jax.distributed`` every process
runs the hooks (the tokens/s count sums every process's rows) and process 0 alone writes the file, reports to
the trackers and shows the bar.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from tunix.sft import hooks
from tqdm.auto import tqdm

from gemport.errors import RecipeError
from gemport.recipe import OutputsFields
from gemport.run import trackers
from gemport.data.order import StepPlan, micro_batches_per_epoch
from gemport.data.steps import PerStep, StepBatches
from gemport.data.stream import StreamBatches, StreamPlan
from gemport.run.trainer import EXAMPLE_LOSS, final_evaluation

TRAINER_STATE = "trainer_state.json"

class HFOutputs(hooks.TrainingHooks):
    """Writes ``output_dir/trainer_state.json`` (HF's ``TrainerState``), reports each entry to the trackers
    ``report_to`` names (``gemport.run.trackers``), and shows a tqdm bar with loss, grad_norm, learning rate
    and tokens/s. ``finish()`` after ``train()``. Raises before training when ``report_to`` names a tracker
    gemport does not report to or that is not installed.

    Args:
      output_dir: where ``trainer_state.json`` goes.
      args: the run's ``SFTConfig`` fields (logging, eval and save cadence, ``report_to``, ``disable_tqdm``).
      epochs: each optimizer step's epoch as HF counts it, float [max_steps] (`step_epochs`).
      tokens: each optimizer step's tokens over all processes, int [max_steps] (`step_tokens`).
      eval_every: Tunix's ``eval_every_n_steps``.
      learning_rate: the schedule, ``step -> learning rate`` (``optim.hf_optimizer(...).schedule``).
      tracker_config: what trackers record of the run: ``base_dir``, ``lora_config`` (PEFT's dict),
        ``num_parameters`` (``trackers.open_trackers``' keywords).
      command: the command the progress bar names (``gemport sft``, ``gemport dpo``).
    """

    def __init__(self, output_dir: str | os.PathLike, args: Any, *, epochs: Sequence[float], tokens: Sequence[int],
                 eval_every: int | None, learning_rate: Callable[[int], Any],
                 tracker_config: Mapping[str, Any], command: str = "sft"):
        f = OutputsFields.from_config(args)
        if f.logging_strategy != "steps":
            raise RecipeError(f"SFTConfig.logging_strategy={f.logging_strategy!r}: gemport logs by "
                                       "'steps' (logging_steps)")

        self.out, self.args = Path(output_dir), args
        self.max_steps = len(epochs)
        self.logging_steps = steps_of(f.logging_steps, self.max_steps, "logging_steps")
        self.first = bool(f.logging_first_step)
        self.eval_every = eval_every
        self.eval_on_start = bool(f.eval_on_start)
        self.fields = f
        trackers.names(f.report_to)
        self.epochs, self.tokens = epochs, tokens
        self.learning_rate, self.tracker_config = learning_rate, dict(tracker_config)
        self.command = command
        self.primary = jax.process_index() == 0
        self.history: list[dict[str, Any]] = []
        self.window: list[float] = []
        self.pending: list[dict[str, Any]] = []  # eval entries wait for their step's train entry, as HF orders them
        self.bar = None
        self.trackers: list[trackers.Tracker] = []
        self.start_step = 0
        self.clock = time.perf_counter()

    def _begin(self, trainer: Any) -> None:
        # Once, at the first event: Tunix evaluates before it calls on_train_start.
        if self.bar is not None:
            return
        self.start_step = trainer.train_steps
        state = self.out / TRAINER_STATE
        if self.start_step and state.is_file():
            self.history = [e for e in json.loads(state.read_text()).get("log_history", [])
                            if e.get("step", 0) <= self.start_step]
        self.bar = tqdm(total=self.max_steps, initial=self.start_step, desc=f"gemport {self.command}",
                        unit="step", disable=bool(self.fields.disable_tqdm) or not self.primary)
        if self.primary:
            self.trackers = trackers.open_trackers(self.args, **self.tracker_config, output_dir=self.out,
                                                   start_step=self.start_step)
        self.clock = time.perf_counter()

    def on_train_start(self, trainer: Any) -> None:
        self._begin(trainer)
        trainer.close_progress_bar()  # Tunix's own bar (loss and perplexity only): this one replaces it
        self.clock = time.perf_counter()

    def _latest(self, trainer: Any, name: str, mode: str) -> float:
        return float(np.asarray(trainer.metrics_logger.get_metric_history("", name, mode))[-1])

    def on_train_step_end(self, trainer: Any, train_step: int, train_loss: Any) -> None:
        self._begin(trainer)
        step = int(train_step)
        now = time.perf_counter()
        elapsed, self.clock = now - self.clock, now
        loss = float(train_loss)
        grad_norm = self._latest(trainer, "grad_norm", "train")
        learning_rate = float(self.learning_rate(step - 1))
        self.window.append(loss)
        self.bar.set_postfix(loss=f"{loss:.4f}", grad_norm=f"{grad_norm:.3f}", lr=f"{learning_rate:.2e}",
                             tokens_per_s=f"{self.tokens[step - 1] / max(elapsed, 1e-9):.0f}", refresh=False)
        self.bar.update(step - self.bar.n)
        if step % self.logging_steps == 0 or (self.first and step == 1):
            entry = {"epoch": self.epochs[step - 1], "grad_norm": grad_norm, "learning_rate": learning_rate,
                     "loss": float(np.mean(self.window)), "step": step}
            entry.update({name: self._latest(trainer, name, "train") for name in trainer.LOGGED})
            self.window = []
            self._log(entry)
        self._flush(step)

    def on_eval_step_end(self, trainer: Any, eval_loss: Any) -> None:
        self._begin(trainer)
        step = trainer.train_steps
        due = (step % self.eval_every == 0 or final_evaluation(step, self.eval_every, self.max_steps) if step
               else self.eval_on_start)
        if not due or any(e.get("step") == step and "eval_loss" in e for e in self.history):
            return  # Tunix also evaluates when train() starts; HF does not, unless eval_on_start
        entry = {"epoch": self.epochs[step - 1] if step else 0.0,
                 "eval_loss": self._latest(trainer, EXAMPLE_LOSS, "eval"), "step": step}
        entry.update({f"eval_{name}": self._latest(trainer, name, "eval") for name in trainer.LOGGED})
        self.pending.append(entry)
        if step <= self.start_step:  # the evaluation when a run starts or resumes: its train entry is written
            self._flush(step)

    def _flush(self, step: int) -> None:
        while self.pending and self.pending[0]["step"] <= step:
            self._log(self.pending.pop(0))

    def _log(self, entry: dict[str, Any]) -> None:
        self.history.append(entry)
        self._write_state()
        for tracker in self.trackers:
            tracker.log(trackers.hf_names(entry), entry["step"])

    def _write_state(self) -> None:
        if not self.primary:
            return
        step = max((e["step"] for e in self.history), default=self.start_step)
        state = {
            "best_global_step": None, "best_metric": None, "best_model_checkpoint": None,
            "epoch": self.epochs[step - 1] if step else 0.0, "eval_steps": self.eval_every, "global_step": step,
            "is_hyper_param_search": False, "is_local_process_zero": True, "is_world_process_zero": True,
            "log_history": self.history, "logging_steps": self.logging_steps, "max_steps": self.max_steps,
            "num_input_tokens_seen": 0, "num_train_epochs": math.ceil(self.epochs[-1]),
            "save_steps": self.fields.save_steps, "stateful_callbacks": {}, "total_flos": 0.0,
            "train_batch_size": self.fields.per_device_train_batch_size, "trial_name": None, "trial_params": None,
        }
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / f".{TRAINER_STATE}.{os.getpid()}"
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        os.replace(tmp, self.out / TRAINER_STATE)

    def finish(self) -> None:
        """Write what is pending, close the bar and end the trackers' runs (Tunix logs the last step after
        ``on_train_end``, so this comes after ``train()``)."""
        self._flush(self.max_steps)
        if self.bar is not None:
            self.bar.close()
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []

    def on_train_end(self, trainer: Any) -> None: ...
    def on_train_step_start(self, trainer: Any) -> None: ...
    def on_eval_step_start(self, trainer: Any) -> None: ...


def steps_of(value: float | int, max_steps: int, name: str) -> int:
    """HF's reading of ``logging_steps`` / ``eval_steps`` / ``save_steps``: below 1 a ratio of ``max_steps``."""
    if not value or value <= 0:
        raise RecipeError(f"SFTConfig.{name}={value!r}: give a positive number of steps (or a ratio < 1)")
    return math.ceil(value * max_steps) if value < 1 else int(value)


def step_epochs(plan: Sequence[Any] | StepPlan | StreamPlan, num_units: int | None, args: Any) -> Sequence[float]:
    """Each optimizer step's epoch as HF counts it: micro-batches done over the micro-batches of a whole epoch.

    Args:
      plan: the run's ``OptimizerStep``s (``data.optimizer_steps``), or its ``data.StepPlan`` (whose epochs come
        from its geometry, no sample order drawn) or ``data.StreamPlan`` (HF's passes over a stream).
      num_units: the training rows (examples, or packed rows) of one epoch.
      args: the ``SFTConfig`` fields (``per_device_train_batch_size``, ``dataloader_drop_last``).

    Returns a float per step.
    """
    if isinstance(plan, (StepPlan, StreamPlan)):
        return plan.epochs()
    f = OutputsFields.from_config(args)
    per_epoch = micro_batches_per_epoch(num_units, f.per_device_train_batch_size, f.dataloader_drop_last)
    done: dict[int, int] = {}
    epochs = []
    for s in plan:
        done[s.epoch] = done.get(s.epoch, 0) + len(s.micro_batches)
        epochs.append(s.epoch + done[s.epoch] / per_epoch)
    return epochs


def step_tokens(train_batches: Sequence[Mapping[str, np.ndarray]] | StepBatches | StreamBatches) -> Sequence[int]:
    """Each optimizer step's tokens (``segment_ids`` > 0 of its batch [A, B, T]), summed over the processes of a
    ``jax.distributed`` run: of a ``data.StepBatches`` (or ``StreamBatches``), counted from its examples when read
    (no batch built, no collective); of a list, each process holding its own rows of every step, a collective on
    every process."""
    if isinstance(train_batches, (StepBatches, StreamBatches)):
        return PerStep(len(train_batches), train_batches.tokens)
    tokens = np.array([int((b["segment_ids"] > 0).sum()) for b in train_batches], np.int64)
    if jax.process_count() > 1:
        tokens = multihost_utils.process_allgather(tokens).sum(axis=0)
    return tokens.tolist()


__all__ = ["TRAINER_STATE", "HFOutputs", "step_epochs", "step_tokens", "steps_of"]
