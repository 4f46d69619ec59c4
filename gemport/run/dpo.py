"""One TRL DPO run on JAX devices, as one object: ``DPORun.create(dpo_config, base_dir, data, lora=...)``.

``DPORun`` is ``run.sft.SFTRun`` with DPO's data and loss: the same model loading, mesh, HF sample order
(``data.order``: each optimizer step's pairs), optimizer and schedule (``optim.hf_optimizer``), Tunix trainer
with Orbax checkpoints, exact resume and SIGTERM handling (``run.trainer.HFPeftTrainer``), recipe record
(``run.record``), outputs (``run.outputs.HFOutputs``: ``trainer_state.json`` with TRL's DPO metric names,
TensorBoard...) and PEFT exports. What changes: the rows are ``data.collate``'s pairs ([chosen; rejected], each
micro-batch [2B, T]) and the trainer's loss is ``step.dpo_loss`` (``DPOPeftTrainer``), the reference being the
base with LoRA off, as TRL given ``peft_config`` (or the starting adapter, as TRL given a ``PeftModel``).

TRL's gradient accumulation for DPO is the mean over the step's micro-batches of each one's mean per-pair loss
(HF divides each by the step's micro-batch count). Tunix's accumulation (``optax.MultiSteps``) takes that mean
with equal weights over A micro-batches; a short last step of an epoch is padded with empty micro-batches, so
each micro-batch carries ``trainer.MICRO_BATCHES`` (the step's real ones, n) and its loss is scaled by A / n: the
mean is then over the real ones, as TRL's.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal, NamedTuple

import grain
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gemport.data.batching import stack
from gemport.data.formats import read as records
from gemport.data.order import optimizer_steps
from gemport.data.pairs import Preference, collate, preferences
from gemport.data.truncation import TruncationReport
from gemport.data.vocabulary import check_token_ids
from gemport.errors import RecipeError
from gemport.lora import LoraParams, LoraSpec
from gemport.recipe import PreferenceFields, trainer_fields
from gemport.run.dpo_trainer import MICRO_BATCHES, DPOPeftTrainer
from gemport.run.sft import RunRecipe, SFTRun, eval_cuts, load_tokenizer, lora_spec_of
from gemport.run.trainer import NUM_ITEMS, micro_batches
from gemport.specs import GemmaSpec
from gemport.step.dpo import DPOLoss, from_dpo_config

Reference = Literal["base", "adapter"]


def dpo_fields(config: Any) -> dict[str, Any]:
    """Every ``DPOConfig`` field of ``config``: a ``DPOConfig``, a dict of its fields, or a ``trl dpo --config``
    YAML (``gemport.recipe.trainer_fields``: a dict or a YAML read as ``trl dpo`` reads it, an unknown or refused
    field raising ``RecipeError``; the others at TRL's defaults, read from ``trl.DPOConfig``)."""
    return trainer_fields(config, "dpo")


class _Row(NamedTuple):  # what run.record.data_hash reads of a row
    tokens: np.ndarray
    loss_mask: np.ndarray


def _rows(pairs: list[Preference]) -> list[_Row]:
    """Each pair's chosen and rejected rows (prompt + completion), as the record and the token check read them."""
    return [_Row(np.concatenate([p.prompt_ids, c]), np.r_[np.zeros(len(p.prompt_ids), bool), np.ones(len(c), bool)])
            for p in pairs for c in (p.chosen_ids, p.rejected_ids)]


def preference_batches(pairs: list[Preference], args: Mapping[str, Any], *, pad_id: int = 0
                       ) -> tuple[list[Any], list[dict[str, np.ndarray]]]:
    """(``data.order.OptimizerStep``s, batches) of HF's sample order over ``pairs``, for the ``DPOConfig`` fields
    ``args`` (their order, ``optimizer_steps``'s, and ``PreferenceFields``): step s's batch maps
    ``BATCH_FIELDS`` to [A, 2B, T] (A = gradient_accumulation_steps micro-batches of ``data.collate``'s B pair
    slots; a short micro-batch or step padded with empty ones), T one width for every step (the longest
    truncated row, rounded up to ``pad_to_multiple_of``), so the step compiles once."""
    f = PreferenceFields.from_config(args)
    plan = list(optimizer_steps(args, len(pairs)))
    width = _width(pairs, f)
    batches = []
    for s in plan:
        micro = [collate([pairs[i] for i in m], max_length=f.max_length, truncation_mode=f.truncation_mode,
                         width=width, slots=f.per_device_train_batch_size, pad_id=pad_id)
                 for m in s.micro_batches]
        batches.append(stack(micro, accumulation=f.gradient_accumulation_steps))
    return plan, batches


def eval_preference_batches(pairs: list[Preference], args: PreferenceFields | Mapping[str, Any], *, pad_id: int = 0
                            ) -> list[dict[str, np.ndarray]]:
    """Eval batches of ``pairs`` in order, as HF's eval dataloader cuts them (``args``: the ``DPOConfig`` fields,
    or their ``PreferenceFields``): each maps ``BATCH_FIELDS`` to
    [1, 2B, T] (B = per_device_eval_batch_size pair slots); the last keeps its odd pairs (its other slots empty),
    unless ``dataloader_drop_last`` drops it. T: the longest truncated eval row, rounded up to
    ``pad_to_multiple_of``. Raises ``RecipeError`` when no batch is left."""
    f = args if isinstance(args, PreferenceFields) else PreferenceFields.from_config(args)
    size = f.per_device_eval_batch_size
    cuts = eval_cuts(pairs, size, f.dataloader_drop_last)
    width = _width([p for cut in cuts for p in cut], f)
    return [stack([collate(cut, max_length=f.max_length, truncation_mode=f.truncation_mode, width=width,
                           slots=size, pad_id=pad_id)], accumulation=1) for cut in cuts]


def _width(pairs: list[Preference], f: PreferenceFields) -> int:
    # One width for every batch (the longest truncated row, rounded up): the step compiles once.
    longest = max(min(len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids)), f.max_length or np.inf)
                  for p in pairs)
    multiple = f.pad_to_multiple_of or 1
    return -(-int(longest) // multiple) * multiple


def preference_micro_batches(steps: Iterable[Mapping[str, np.ndarray]]) -> Any:
    """``run.trainer.micro_batches`` of DPO steps [A, 2B, T], each micro-batch also carrying
    ``run.dpo_trainer.MICRO_BATCHES`` (its step's micro-batches that hold a pair) in place of the target count."""
    steps = list(steps)
    elements = micro_batches(steps)
    accumulation = steps[0]["tokens"].shape[0]
    real = [int(np.asarray(s["segment_ids"]).any(axis=(1, 2)).sum()) for s in steps]

    def element(index):
        out = dict(elements[index])
        rows = out.pop(NUM_ITEMS).shape
        out[MICRO_BATCHES] = np.full(rows, real[index // accumulation], np.int32)
        return out

    return grain.MapDataset.range(len(elements)).map(element)


@dataclasses.dataclass
class DPORun(SFTRun):
    """A TRL DPO recipe on JAX devices: ``SFTRun`` whose data are preference pairs and whose loss is DPO's.

    Built by ``create``, SFT's stages with DPO's ``check``, ``start``, ``data`` and ``extras``. ``pairs``: the
    tokenized ``data.Preference``s kept (TRL drops a pair whose prompt fills ``max_length`` under
    ``keep_start``); ``train_batches[s]`` maps ``BATCH_FIELDS`` to [A, 2B, T]; ``loss``: the ``DPOLoss``;
    ``reference``: None (the base, LoRA off) or the LoRA factors the run started from (an ``nnx.State``);
    ``peft_spec``: the adapter's spec as the recipe gives it (its ``lora_dropout`` too, which the model trains
    without under TRL's ``disable_dropout``); ``eval_batches``: ``eval_preference_batches`` of the eval split, or
    None. ``pipeline``, ``examples``, ``eval_examples``: unused.
    """

    pairs: list[Preference] = dataclasses.field(default_factory=list)
    loss: DPOLoss = dataclasses.field(default_factory=DPOLoss)
    reference: Any = None
    peft_spec: LoraSpec | None = None

    COMMAND: ClassVar[str] = "dpo"

    @classmethod
    def create(cls, dpo_config: Any, base_dir: str | os.PathLike, train_dataset: Any, *,
               init_adapter: str | os.PathLike | None = None, reference: Reference | None = None,
               abstract: bool = False, **kwargs: Any) -> DPORun:
        """Build the DPO run of ``dpo_config`` on ``base_dir`` and ``train_dataset``: ``SFTRun.create``'s stages.

        Args:
          dpo_config: ``DPOConfig``, a dict of its fields, or a ``trl dpo --config`` YAML (its ``use_peft`` +
            ``lora_*`` fields the default ``lora``, its ``dtype`` the default ``dtype``, its 4-bit base fields the
            default ``qlora``).
          base_dir: the HF Gemma checkpoint (with its tokenizer unless ``tokenizer`` is given).
          train_dataset: TRL preference records (``data.preferences``) in any form ``data.formats.read`` reads
            (a list, a ``datasets.Dataset``, a .jsonl/.json/.parquet file).
          init_adapter: as ``SFTRun.create``'s.
          reference: ``"base"`` (the base with LoRA off: TRL given ``peft_config``, a fresh adapter) or
            ``"adapter"`` (the factors the run starts from, frozen: TRL given a ``PeftModel``); default
            ``"adapter"`` with ``init_adapter``, else ``"base"``. With ``qlora`` the base is the 4-bit base, as
            TRL's on a bitsandbytes base.
          abstract: the model from ``config.json`` alone, shapes only (``run.model.lora_model``: no weight read),
            for ``gemport.plan.dry_run``; the data are tokenized, as the step's shape is theirs. Such a run is
            compiled, never trained; its reference is the base (an adapter's factors are values the step holds).
          kwargs: ``SFTRun.create``'s other arguments (``lora``, ``eval_dataset``: held-out preference records,
            evaluated every ``eval_steps`` under ``eval_strategy: steps`` as TRL's DPOTrainer evaluates;
            ``mesh``, ``fsdp``, ``tp``, ``dtype``, ``qlora``, ``tokenizer``, ``chat_format`` (renders
            conversational records; default the tokenizer's), ``checkpoint_dir``, ``progress``).

        Returns:
          The `DPORun`, as ``SFTRun.create``'s, with its pairs, loss and reference.

        Raises:
          RecipeError: a field gemport does not reproduce (the loss fields ``step.from_dpo_config`` refuses),
            ``eval_strategy: steps`` without ``eval_dataset``, a reference it cannot take, several processes.
          LoraError, MaskError: as ``SFTRun.create``'s.
        """
        reference = reference or ("adapter" if init_adapter is not None else "base")
        if reference not in ("base", "adapter") or (reference == "adapter" and init_adapter is None):
            raise RecipeError(f"DPORun: reference={reference!r}; give 'base', or 'adapter' with init_adapter")
        if abstract and reference == "adapter":
            raise RecipeError("DPORun: abstract=True plans the base as the reference; an adapter's (init_adapter, "
                              "TRL given a PeftModel) is not planned yet: plan the recipe without --init-adapter")
        return super().create(dpo_config, base_dir, train_dataset, init_adapter=init_adapter, abstract=abstract,
                              reference=reference, **kwargs)

    @classmethod
    def check(cls, recipe: RunRecipe, *, eval_dataset: Any, abstract: bool, **kind: Any) -> None:
        """SFT's checks, then DPO's: one process, and the loss fields gemport reproduces (``from_dpo_config``)."""
        super().check(recipe, eval_dataset=eval_dataset, abstract=abstract)
        if jax.process_count() > 1:
            raise RecipeError("DPORun: DPO under jax.distributed (several processes) is not ported yet; run it on "
                              "one host")
        from_dpo_config(recipe.args)

    @classmethod
    def start(cls, recipe: RunRecipe, given: LoraSpec | LoraParams) -> LoraSpec | LoraParams:
        """The adapter as the recipe gives it, without LoRA dropout under ``disable_dropout`` (TRL sets every
        dropout module's p to 0, PEFT's lora_dropout included)."""
        if not PreferenceFields.from_config(recipe.args).disable_dropout:
            return given
        trained = dataclasses.replace(lora_spec_of(given), dropout=0.0)
        return trained if isinstance(given, LoraSpec) else given._replace(lora_spec=trained)

    @classmethod
    def data(cls, recipe: RunRecipe, base_dir: Path, spec: GemmaSpec, mesh, train_dataset: Any, eval_dataset: Any,
             *, tokenizer: Any, chat_format: Any, cache_dir: Any, progress: bool, abstract: bool) -> dict[str, Any]:
        """The tokenizer, the preference pairs (``data.preferences``) in HF's sample order as batches
        [A, 2B, T] and the eval split's, every token id checked against the vocabulary. DPO lays every step's
        batch out here, in memory (``cache_dir`` is SFT's: pairs are not cached yet)."""
        f = PreferenceFields.from_config(recipe.args)
        tokenizer = tokenizer or load_tokenizer(base_dir)
        pairs = preferences(records(train_dataset), tokenizer, chat_format, max_length=f.max_length,
                            truncation_mode=f.truncation_mode)
        if not pairs:
            raise RecipeError(f"no preference pair is left: every prompt fills max_length={f.max_length} "
                              "(TRL drops those under truncation_mode keep_start); raise max_length")
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        plan, batches = preference_batches(pairs, recipe.args, pad_id=pad_id)
        check_token_ids(_rows(pairs), spec.vocab, tokenizer, pad_id=pad_id)
        evals = None
        if eval_dataset is not None:
            held_out = preferences(records(eval_dataset), tokenizer, chat_format, max_length=f.max_length,
                                   truncation_mode=f.truncation_mode)
            check_token_ids(_rows(held_out), spec.vocab, tokenizer, split="eval")
            evals = eval_preference_batches(held_out, f, pad_id=pad_id)
        return dict(tokenizer=tokenizer, pipeline=None, examples=[], report=TruncationReport(), plan=plan,
                    train_batches=batches, eval_examples=None, eval_batches=evals, pairs=pairs)

    @classmethod
    def extras(cls, recipe: RunRecipe, given: LoraSpec | LoraParams, model: nnx.Module, *,
               reference: Reference, **kind: Any) -> dict[str, Any]:
        """DPO's loss, the reference's LoRA factors (copied, frozen) for ``reference="adapter"``, and the
        adapter's spec as the recipe gives it."""
        factors = jax.tree.map(jnp.copy, nnx.state(model, nnx.LoRAParam)) if reference == "adapter" else None
        return dict(loss=from_dpo_config(recipe.args), reference=factors, peft_spec=lora_spec_of(given))

    @classmethod
    def recorded_rows(cls, data: Mapping[str, Any]) -> Sequence[Any]:
        """Each pair's chosen and rejected rows, as the record hashes them."""
        return _rows(data["pairs"])

    @classmethod
    def with_record(cls, record: dict[str, Any], *, reference: Reference, **kind: Any) -> dict[str, Any]:
        """The record, with the reference the run takes."""
        return {**record, "reference": reference}

    @property
    def lora_spec(self) -> LoraSpec:
        """The adapter's spec as the recipe gives it (what exports and checkpoints record)."""
        return self.peft_spec

    @property
    def num_units(self) -> int:
        """The rows HF's sampler orders: the pairs."""
        return len(self.pairs)

    def micro_batches(self, steps, *, skip: int = 0):
        """The trainer's dataset of ``train_batches`` (``preference_micro_batches``; laid out already, so
        ``skip`` spares nothing)."""
        return preference_micro_batches(steps)

    def make_trainer(self, **kwargs: Any):
        """A ``DPOPeftTrainer`` of the current ``model``, ``optimizer``, ``training_config``, ``loss`` and
        ``reference``; as ``SFTRun.make_trainer`` otherwise (resumes from the latest checkpoint in its root)."""
        with self._trainer_placement():
            return DPOPeftTrainer(self.model, self.optimizer.tx, self.training_config, lora_spec=self.lora_spec,
                                  seed=self.fields.seed, precision=self.precision, remats=self.remats, loss=self.loss,
                                  reference=self.reference, **kwargs)


__all__ = ["DPORun", "dpo_fields", "eval_preference_batches", "preference_batches", "preference_micro_batches"]
