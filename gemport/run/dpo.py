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
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gemport.data.pairs import Preference, collate, preferences
from gemport.step.dpo import DPOLoss, from_dpo_config
from gemport.errors import RecipeError
from gemport.lora import LoraSpec, QLoraSpec
from gemport.data.truncation import TruncationReport
from gemport.mesh import make_mesh
from gemport.optim.hf import hf_optimizer
from gemport.specs import GemmaSpec
from gemport.data.order import optimizer_steps
from gemport.run.sft import (SFTRun, check_eval_split, checkpoint_root, eval_cuts, run_model, starting_adapter,
                               training_config)
from gemport.data.batching import stack

Reference = Literal["base", "adapter"]


def dpo_fields(config: Any) -> dict[str, Any]:
    """Every ``DPOConfig`` field of ``config``: a ``DPOConfig``, a dict of its fields, or a ``trl dpo --config``
    YAML (``gemport.recipe.trainer_fields``: a dict or a YAML read as ``trl dpo`` reads it, an unknown or refused
    field raising ``RecipeError``; the others at TRL's defaults, read from ``trl.DPOConfig``)."""
    from gemport.recipe import trainer_fields

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
    """(``data.order.OptimizerStep``s, batches) of HF's sample order over ``pairs``: step s's batch maps
    ``BATCH_FIELDS`` to [A, 2B, T] (A = gradient_accumulation_steps micro-batches of ``data.collate``'s B pair
    slots; a short micro-batch or step padded with empty ones), T one width for every step (the longest
    truncated row, rounded up to ``pad_to_multiple_of``), so the step compiles once."""
    plan = list(optimizer_steps(args, len(pairs)))
    width = _width(pairs, args)
    batches = []
    for s in plan:
        micro = [collate([pairs[i] for i in m], max_length=args["max_length"], truncation_mode=args["truncation_mode"],
                         width=width, slots=args["per_device_train_batch_size"], pad_id=pad_id)
                 for m in s.micro_batches]
        batches.append(stack(micro, accumulation=args["gradient_accumulation_steps"]))
    return plan, batches


def eval_preference_batches(pairs: list[Preference], args: Mapping[str, Any], *, pad_id: int = 0
                            ) -> list[dict[str, np.ndarray]]:
    """Eval batches of ``pairs`` in order, as HF's eval dataloader cuts them: each maps ``BATCH_FIELDS`` to
    [1, 2B, T] (B = per_device_eval_batch_size pair slots); the last keeps its odd pairs (its other slots empty),
    unless ``dataloader_drop_last`` drops it. T: the longest truncated eval row, rounded up to
    ``pad_to_multiple_of``. Raises ``RecipeError`` when no batch is left."""
    size = args["per_device_eval_batch_size"]
    cuts = eval_cuts(pairs, size, args["dataloader_drop_last"])
    width = _width([p for cut in cuts for p in cut], args)
    return [stack([collate(cut, max_length=args["max_length"], truncation_mode=args["truncation_mode"], width=width,
                           slots=size, pad_id=pad_id)], accumulation=1) for cut in cuts]


def _width(pairs: list[Preference], args: Mapping[str, Any]) -> int:
    # One width for every batch (the longest truncated row, rounded up): the step compiles once.
    longest = max(min(len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids)), args["max_length"] or np.inf)
                  for p in pairs)
    multiple = args["pad_to_multiple_of"] or 1
    return -(-int(longest) // multiple) * multiple


def preference_micro_batches(steps: Iterable[Mapping[str, np.ndarray]]) -> Any:
    """``run.trainer.micro_batches`` of DPO steps [A, 2B, T], each micro-batch also carrying
    ``run.dpo_trainer.MICRO_BATCHES`` (its step's micro-batches that hold a pair) in place of the target count."""
    import grain

    from gemport.run.dpo_trainer import MICRO_BATCHES
    from gemport.run.trainer import NUM_ITEMS, micro_batches

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

    Built by ``create``. ``pairs``: the tokenized ``data.Preference``s kept (TRL drops a pair whose prompt fills
    ``max_length`` under ``keep_start``); ``train_batches[s]`` maps ``BATCH_FIELDS`` to [A, 2B, T];
    ``loss``: the ``DPOLoss``; ``reference``: None (the base, LoRA off) or the LoRA factors the run started from
    (an ``nnx.State``); ``peft_spec``: the adapter's spec as the recipe gives it (its ``lora_dropout`` too, which
    the model trains without under TRL's ``disable_dropout``); ``eval_batches``: ``eval_preference_batches`` of
    the eval split, or None. ``pipeline``, ``examples``, ``eval_examples``: unused.
    """

    pairs: list[Preference] = dataclasses.field(default_factory=list)
    loss: DPOLoss = dataclasses.field(default_factory=DPOLoss)
    reference: Any = None
    peft_spec: LoraSpec | None = None

    COMMAND: ClassVar[str] = "dpo"

    @classmethod
    def create(cls, dpo_config: Any, base_dir: str | os.PathLike, train_dataset: Any, *, lora: Any = None,
               eval_dataset: Any = None, init_adapter: str | os.PathLike | None = None,
               reference: Reference | None = None, mesh=None, fsdp: int | None = None, tp: int | None = None,
               dtype: Any = None, qlora: QLoraSpec | None = None,
               tokenizer: Any = None, chat_format: Any = None, checkpoint_dir: str | os.PathLike | None = None,
               progress: bool = True, abstract: bool = False) -> DPORun:
        """Build the DPO run of ``dpo_config`` on ``base_dir`` and ``train_dataset``.

        dpo_config: ``DPOConfig``, a dict of its fields, or a ``trl dpo --config`` YAML (its ``use_peft`` +
            ``lora_*`` fields the default ``lora``, its ``dtype`` the default ``dtype``, its 4-bit base fields the
            default ``qlora``). base_dir: the HF Gemma checkpoint (with its tokenizer unless ``tokenizer`` is
            given). train_dataset: TRL preference records
            (``data.preferences``) in any form ``data.formats.read`` reads (a list, a ``datasets.Dataset``, a
            .jsonl/.json/.parquet file).
        eval_dataset: held-out preference records, in the same forms: evaluated every ``eval_steps`` under
            ``eval_strategy: steps`` (``eval_loss`` and TRL's ``eval_rewards/*``, ``eval_logps/*``), as TRL's
            DPOTrainer evaluates; required by that strategy.
        lora, init_adapter, mesh, fsdp, tp, dtype, qlora, checkpoint_dir: as ``SFTRun.create``'s. With ``qlora``
            (QLoRA: the base loaded 4-bit by ``load_qlora_model``) the reference is that 4-bit base with LoRA off,
            as TRL's on a bitsandbytes base.
        reference: ``"base"`` (the base with LoRA off: TRL given ``peft_config``, a fresh adapter) or
            ``"adapter"`` (the factors the run starts from, frozen: TRL given a ``PeftModel``); default
            ``"adapter"`` with ``init_adapter``, else ``"base"``.
        chat_format: renders conversational records (default: the tokenizer's, ``data.template.chat_format``).
        abstract: the model from ``config.json`` alone, shapes only (``run.model.lora_model``: no weight read),
            for ``gemport.plan.dry_run``; the data are tokenized, as the step's shape is theirs. Such a run is
            compiled, never trained; its reference is the base (an adapter's factors are values the step holds).

        Raises RecipeError naming a field gemport does not reproduce (the loss fields ``step.from_dpo_config``
        refuses), or ``eval_strategy: steps`` without ``eval_dataset``; LoraError, MaskError.
        """
        import transformers

        from gemport.data.formats import read as records
        from gemport.recipe import check_strategies
        from gemport.run.record import recipe_record
        from gemport.data.sft import remat_of
        from gemport.data.vocabulary import check_token_ids

        if isinstance(dpo_config, (str, os.PathLike)):
            from gemport.recipe import read

            recipe = read(dpo_config, command="dpo")
            args, lora = recipe.sft, lora if lora is not None else recipe.lora()
            dtype = dtype if dtype is not None else recipe.dtype()
            qlora = qlora if qlora is not None else recipe.qlora()
        else:
            args = dpo_fields(dpo_config)
        check_strategies(args)
        if not abstract:  # an abstract run is compiled, never evaluated
            check_eval_split(args["eval_strategy"], eval_dataset)
        if jax.process_count() > 1:
            raise RecipeError("DPORun: DPO under jax.distributed (several processes) is not ported yet; run it on "
                              "one host")
        loss = from_dpo_config(args)
        from gemport.run import trackers

        trackers.names(args["report_to"])  # a missing tracker fails before the load
        base_dir = Path(base_dir)
        spec = GemmaSpec.from_hf(base_dir)
        start = starting_adapter(lora, init_adapter, base_dir, "DPORun")
        peft_spec = start if isinstance(start, LoraSpec) else start.lora_spec
        if args["disable_dropout"]:  # TRL sets every dropout module's p to 0, PEFT's lora_dropout included
            trained = dataclasses.replace(peft_spec, dropout=0.0)
            start = trained if isinstance(start, LoraSpec) else start._replace(lora_spec=trained)
        reference = reference or ("adapter" if init_adapter is not None else "base")
        if reference not in ("base", "adapter") or (reference == "adapter" and init_adapter is None):
            raise RecipeError(f"DPORun: reference={reference!r}; give 'base', or 'adapter' with init_adapter")
        if abstract and reference == "adapter":
            raise RecipeError("DPORun: abstract=True plans the base as the reference; an adapter's (init_adapter, "
                              "TRL given a PeftModel) is not planned yet: plan the recipe without --init-adapter")

        tokenizer = tokenizer or transformers.AutoTokenizer.from_pretrained(base_dir)
        pairs = preferences(records(train_dataset), tokenizer, chat_format, max_length=args["max_length"],
                            truncation_mode=args["truncation_mode"])
        if not pairs:
            raise RecipeError(f"no preference pair is left: every prompt fills max_length={args['max_length']} "
                              "(TRL drops those under truncation_mode keep_start); raise max_length")
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        plan, batches = preference_batches(pairs, args, pad_id=pad_id)
        rows = _rows(pairs)
        check_token_ids(rows, spec.vocab, tokenizer, pad_id=pad_id)  # before the model loads
        evals = None
        if eval_dataset is not None:
            held_out = preferences(records(eval_dataset), tokenizer, chat_format, max_length=args["max_length"],
                                   truncation_mode=args["truncation_mode"])
            check_token_ids(_rows(held_out), spec.vocab, tokenizer, split="eval")
            evals = eval_preference_batches(held_out, args, pad_id=pad_id)
        mesh = mesh if mesh is not None else make_mesh(spec, fsdp=fsdp, tp=tp)
        if dtype is None:
            dtype = jnp.bfloat16 if args["bf16"] else jnp.float32
        model = run_model(base_dir, spec, start, mesh=mesh, dtype=dtype, seed=args["seed"], remat=remat_of(args),
                          qlora=qlora, abstract=abstract)
        factors = None
        if reference == "adapter":
            from flax import nnx

            factors = jax.tree.map(jnp.copy, nnx.state(model, nnx.LoRAParam))  # values, frozen
        if checkpoint_dir is None and not abstract:
            checkpoint_dir = checkpoint_root(args)
        record = recipe_record(args, base_dir=base_dir, dtype=dtype, lora_spec=model.lora_spec, qlora=qlora,
                               examples=rows)
        record["reference"] = reference
        return cls(args=args, base_dir=base_dir, spec=spec, mesh=mesh, model=model, tokenizer=tokenizer,
                   pipeline=None, examples=[], report=TruncationReport(), plan=plan, train_batches=batches,
                   eval_examples=None, eval_batches=evals,
                   optimizer=hf_optimizer(args, num_training_steps=len(batches)),
                   training_config=training_config(args, len(batches), checkpoint_dir=checkpoint_dir,
                                                   evaluate=evals is not None),
                   record=record, pairs=pairs, loss=loss, reference=factors, peft_spec=peft_spec)

    @property
    def lora_spec(self) -> LoraSpec:
        """The adapter's spec as the recipe gives it (what exports and checkpoints record)."""
        return self.peft_spec

    @property
    def num_units(self) -> int:
        """The rows HF's sampler orders: the pairs."""
        return len(self.pairs)

    def micro_batches(self, steps):
        """The trainer's dataset of ``train_batches`` (``preference_micro_batches``)."""
        return preference_micro_batches(steps)

    def make_trainer(self, **kwargs: Any):
        """A ``DPOPeftTrainer`` of the current ``model``, ``optimizer``, ``training_config``, ``loss`` and
        ``reference``; as ``SFTRun.make_trainer`` otherwise (resumes from the latest checkpoint in its root)."""
        from gemport.run.dpo_trainer import DPOPeftTrainer

        with self._trainer_placement():
            return DPOPeftTrainer(self.model, self.optimizer.tx, self.training_config, lora_spec=self.lora_spec,
                                  seed=self.args["seed"], loss=self.loss, reference=self.reference, **kwargs)


__all__ = ["DPORun", "dpo_fields", "eval_preference_batches", "preference_batches", "preference_micro_batches"]
