"""One TRL SFT run on JAX devices, as one object: ``SFTRun.create(sft_config, base_dir, data, lora=...)``.

Every fact of the run is read once, from the ``SFTConfig``: the optimizer steps (``max_steps`` or the
epochs over the data, as HF's Trainer counts them), gradient accumulation, batch sizes, sequence length,
sample order, optimizer and schedule, evaluation and checkpoint cadence. The pieces built from it are the
existing primitives, each an attribute that can be read or replaced before ``train()``:

- ``model``: the Tunix Gemma on ``mesh`` with LoRA (``apply_lora``; it carries ``lora_spec``),
- ``pipeline``, ``examples``, ``report``: ``from_sft_config`` and its masked, fitted examples,
- ``train_batches``: one [A, B, T] batch per optimizer step in HF's order; ``eval_batches``: [1, B, T],
- ``optimizer``: ``optim.hf_optimizer`` (its ``schedule`` gives each step's learning rate),
- ``training_config``: Tunix's ``TrainingConfig``; ``trainer``: the ``HFPeftTrainer`` ``train()`` builds.

Under ``jax.distributed`` (one process per host, ``jax.distributed.initialize`` called first) every process
builds the same run on a mesh spanning all of them: each lays out only the rows of every batch its own
devices hold (``data.distributed``), the trainer assembles the global batches, Orbax writes each checkpoint
from every process, and ``lora_params`` gathers the trained factors for process 0 to export.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import dataclasses
import functools
import itertools
import json
import math
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils
from tunix.sft.peft_trainer import TrainingConfig

from gemport._src.extras import require
from gemport._src.params import flat_params
from gemport.checkpoint import export_merged, export_peft, import_peft, load_lora, load_model
from gemport.checkpoint.quantize import load_qlora_model, require_double_quant
from gemport.data.batching import pad, stack
from gemport.data.chat_template import check_records, with_chat_template
from gemport.data.distributed import batch_sharding, process_rows
from gemport.data.gemma3 import Gemma3
from gemport.data.gemma4 import Gemma4
from gemport.data.flat import FlatExamples
from gemport.data.order import OptimizerStep, StepPlan
from gemport.data.formats import read as records
from gemport.data.packing import TRL_PACKING_BATCH
from gemport.data.prepared import Prepared
from gemport.data.steps import StepBatches
from gemport.data.stream import StreamBatches, StreamPlan, streamed
from gemport.data.sft import SFTPipeline, from_sft_config, remat_of
from gemport.data.tokenize import Example
from gemport.data.truncation import TruncationReport
from gemport.data.vocabulary import check_token_ids
from gemport.errors import LoraError, MaskError, RecipeError
from gemport.lora import LoraLayout, LoraParams, LoraSpec, QLoraSpec, apply_lora
from gemport.lora.config import peft_default_targets
from gemport.mesh import make_mesh, use_mesh
from gemport.optim.hf import HFOptimizer, hf_optimizer
from gemport.recipe import RunFields, check_strategies, read, trainer_fields
from gemport.run import trackers
from gemport.run.lock import claim_output
from gemport.run.model import lora_model
from gemport.run.outputs import HFOutputs, step_epochs, step_tokens, steps_of
from gemport.run.preemption import Preemption
from gemport.run.record import check_resume, recipe_record
from gemport.run.trainer import HFPeftTrainer, micro_batches, prefetched
from gemport.specs import GemmaSpec
from gemport.step.precision import Precision, matmul_precision
from gemport.step.fit import fit_remats
from gemport.step.remat import set_remat

CHECKPOINTS = "checkpoints"
"""The Orbax checkpoint root inside ``output_dir`` (``<output_dir>/checkpoints/<step>``)."""

def sft_fields(config: Any) -> dict[str, Any]:
    """Every ``SFTConfig`` field of ``config``: an ``SFTConfig``, a dict of its fields, or a ``trl sft --config``
    YAML path (``gemport.recipe.trainer_fields``: a dict or a YAML read as ``trl sft`` reads it, an unknown or
    refused field raising ``RecipeError``; the others at TRL's defaults). Returned as a new dict."""
    return trainer_fields(config)


def run_fields(config: RunFields | Any) -> RunFields:
    """``config``'s ``RunFields``: itself when it is one, else read from it (``RunFields.from_config``)."""
    return config if isinstance(config, RunFields) else RunFields.from_config(config)


def load_tokenizer(base_dir: str | os.PathLike) -> Any:
    """The HF tokenizer of ``base_dir`` (``AutoTokenizer.from_pretrained``).

    Raises ``MissingDependencyError`` naming the extra when transformers is not installed."""
    return require("transformers", "loading the base checkpoint's tokenizer").AutoTokenizer.from_pretrained(base_dir)


def lora_spec_of(lora: Any) -> LoraSpec:
    """A ``LoraSpec`` from a ``LoraSpec``, ``LoraParams`` (its spec), ``peft.LoraConfig``, its dict, or an
    ``adapter_config.json`` / its directory."""
    if isinstance(lora, LoraParams):
        return lora.lora_spec
    return lora if isinstance(lora, LoraSpec) else LoraSpec.from_peft(lora)


def eval_batches(examples: Sequence[Example], batch_size: int, *, pad_id: int = 0,
                 pad_to_multiple_of: int | None = None, drop_last: bool = False) -> list[dict[str, np.ndarray]]:
    """Eval batches [1, batch_size, T] of ``examples`` in order, one padded example a row; the last batch keeps
    its odd examples (its missing rows are empty: no target), unless ``drop_last`` (HF's ``dataloader_drop_last``,
    which its eval dataloader honours too) drops it. T is the longest example, rounded up."""
    cuts = eval_cuts(examples, batch_size, drop_last)
    multiple = pad_to_multiple_of or 1
    width = math.ceil(max(len(e.tokens) for cut in cuts for e in cut) / multiple) * multiple
    return [stack([pad(cut, width, pad_id=pad_id)], accumulation=1, rows=batch_size) for cut in cuts]


def eval_cuts(items: Sequence[Any], batch_size: int, drop_last: bool) -> list[Sequence[Any]]:
    """``items`` in order as HF's eval dataloader cuts them: batches of ``batch_size``, the last shorter unless
    ``drop_last`` (``dataloader_drop_last``, which HF's eval dataloader honours too) drops it. Raises
    ``RecipeError`` when no batch is left."""
    if drop_last:
        items = items[:len(items) // batch_size * batch_size]
    if not items:
        raise RecipeError("no eval example" + (f" (dataloader_drop_last drops all, fewer than "
                                               f"per_device_eval_batch_size={batch_size})" if drop_last else ""))
    return [items[i:i + batch_size] for i in range(0, len(items), batch_size)]


def check_eval_split(eval_strategy: str, eval_dataset: Any) -> None:
    """Raises ``RecipeError`` for an ``eval_strategy`` that evaluates without an eval dataset, as HF's Trainer
    refuses it (accepted, it would evaluate nothing)."""
    if eval_strategy != "no" and eval_dataset is None:
        raise RecipeError(f"eval_strategy={eval_strategy!r} needs an eval dataset (the recipe's "
                          "dataset_test_split); pass eval_dataset, or set eval_strategy: 'no'")


@dataclasses.dataclass(frozen=True)
class RunRecipe:
    """A recipe as a run reads it, once (``SFTRun.read``); every later stage takes it.

    Attributes:
      args: every field of the trainer config (``SFTConfig`` / ``DPOConfig``), a dict, absent ones at TRL's
        defaults (``recipe.trainer_fields``, or a YAML's as ``gemport.recipe.read`` reads it).
      fields: the run's own typed group of them (``RunFields``).
      lora: the LoRA config given, else the YAML's ``use_peft`` + ``lora_*`` fields (None: none).
      qlora: the 4-bit base (``QLoraSpec``), given or the YAML's ``load_in_4bit`` fields; None: unquantized.
      dtype: the base weights' dtype: given, else the YAML's ``dtype``, else bfloat16 with ``bf16``, else float32.
    """
    args: dict[str, Any]
    fields: RunFields
    lora: Any
    qlora: QLoraSpec | None
    dtype: Any


@dataclasses.dataclass
class SFTRun:
    """A TRL SFT recipe on JAX devices: the model, its data, optimizer and Tunix trainer, built once.

    Built by ``create``; every attribute may be replaced before ``train()`` (the trainer is built from them
    then).

    Attributes:
      args: the recipe's ``SFTConfig`` fields, a dict (``RunRecipe.args``).
      fields: their ``RunFields`` (``RunRecipe.fields``), what the run itself reads of them.
      base_dir: the HF checkpoint directory the model was loaded from.
      spec: its architecture (``GemmaSpec.from_hf(base_dir)``).
      mesh: the ``("fsdp", "tp")`` mesh the model is placed on.
      model: the Tunix Gemma with Qwix LoRA and the remat of ``gradient_checkpointing``; shapes only for an
        ``abstract`` run.
      tokenizer: the HF tokenizer the data was tokenized with (None for an abstract run without one).
      pipeline: the `SFTPipeline` of the recipe (``from_sft_config``).
      examples: the tokenized training examples, read from the prepared-data cache (``data.FlatExamples``:
        each a ``Stored`` of tokens int32 [n] and loss_mask bool [n]).
      report: what truncation at ``max_length`` cut or dropped (``TruncationReport``).
      plan: the ``OptimizerStep`` of every step (``data.StepPlan``, each built when read): the rows (``units``)
        each micro-batch takes, in HF's order.
      train_batches: one batch per optimizer step, mapping ``BATCH_FIELDS`` to [A, B, T] (A =
        gradient_accumulation_steps, B = per_device_train_batch_size rows, or 1 padding-free row): a
        ``data.StepBatches``, which builds a step's batch from the cache when it is read and holds none.
      eval_examples: the tokenized ``eval_dataset``, or None.
      eval_batches: the eval split as batches [1, per_device_eval_batch_size, T_eval], or None.
      optimizer: HF's optimizer and schedule in Optax (``optim.hf_optimizer``: ``tx``, ``schedule``).
      training_config: Tunix's ``TrainingConfig`` (steps, accumulation, eval and checkpoint settings).
      trainer: the ``HFPeftTrainer``, built by ``train()`` (or ``make_trainer``) when None.
      record: what the recipe trains (``run.record.recipe_record``), kept beside the checkpoints so a rerun
        resumes only the same recipe.
      remats: the remats the trainer's first step tries, in order, for ``gradient_checkpointing``
        (``step.fit.fit_remats``: on a TPU "projections", then decoder remat where XLA refuses it for the chips'
        memory); the model starts at the first. Empty: the model's remat, as set.
    """
    args: dict[str, Any]
    fields: RunFields
    base_dir: Path
    spec: GemmaSpec
    mesh: jax.sharding.Mesh | None
    model: Any
    tokenizer: Any
    pipeline: SFTPipeline | None
    examples: Sequence[Example] | FlatExamples
    report: TruncationReport
    plan: Sequence[OptimizerStep] | StepPlan | StreamPlan
    train_batches: Sequence[dict[str, np.ndarray]] | StepBatches | StreamBatches
    eval_examples: list[Example] | None
    eval_batches: list[dict[str, np.ndarray]] | None
    optimizer: HFOptimizer
    training_config: Any
    trainer: Any = None
    record: dict[str, Any] | None = None
    remats: tuple[str, ...] = ()

    COMMAND: ClassVar[str] = "sft"

    @classmethod
    def create(cls, sft_config: Any, base_dir: str | os.PathLike, train_dataset: Any, *, lora: Any = None,
               eval_dataset: Any = None, init_adapter: str | os.PathLike | None = None, mesh=None,
               fsdp: int | None = None, tp: int | None = None, dtype: Any = None, tokenizer: Any = None,
               chat_format: Any = None, checkpoint_dir: str | os.PathLike | None = None, qlora: Any = None,
               cache_dir: str | os.PathLike | None = None, progress: bool = True, abstract: bool = False,
               **kind: Any) -> SFTRun:
        """Build the run of ``sft_config`` on ``base_dir`` and ``train_dataset``, stage by stage: ``read`` the
        recipe, ``check`` it, the adapter it starts from (``start``), its ``data``, the model (``run_model``),
        what the kind of run adds (``extras``), the optimizer and Tunix's ``training_config``, and the record a
        rerun resumes against (``with_record``). ``DPORun`` overrides the stages where DPO differs.

        The data is prepared once (``cache_dir``) and checked against the vocabulary and the chat template before
        the model loads; see docs/sft.md#the-same-run-in-python and docs/sft.md#data-at-scale.

        Args:
          sft_config: ``SFTConfig``, a dict of its fields, or a ``trl sft --config`` YAML (read as ``trl sft``
            reads it, ``gemport.recipe.read``; its ``use_peft`` + ``lora_*`` fields are the default
            ``lora``, its ``load_in_4bit`` fields the default ``qlora``).
          base_dir: the HF Gemma checkpoint (with its tokenizer unless ``tokenizer`` is given).
          train_dataset: TRL SFT records in any format gemport reads (``data.formats.read``: a list, a
            ``datasets.Dataset``, a .jsonl/.json/.parquet file).
          lora: ``LoraSpec``, ``peft.LoraConfig`` or its dict, ``adapter_config.json`` or its directory, or TRL's
            ``lora_*`` fields; fresh factors from ``seed``. Unset ``target_modules``: PEFT's default for the
            base's ``model_type`` (``lora.config.peft_default_targets``; docs/lora.md#fused-modules-separate-factors).
          eval_dataset: held-out TRL SFT records, in the formats of ``train_dataset``; None: no evaluation.
          init_adapter: a PEFT adapter directory to start from (its factors and spec; ``lora``, if also given,
            must describe the same adapter).
          mesh: default ``make_mesh(spec, fsdp=fsdp, tp=tp)`` over all devices.
          fsdp, tp: the mesh's axis sizes when ``mesh`` is not given (default: ``make_mesh``'s choice).
          dtype: the base weights' dtype; default the YAML's ``dtype`` (``Recipe.dtype``), else bfloat16 if
            ``bf16`` is set, else float32.
          tokenizer: default ``AutoTokenizer.from_pretrained(base_dir)``.
          chat_format: the data's rendering (`from_sft_config`'s); default from the tokenizer's chat template.
          checkpoint_dir: the Orbax root; default ``<output_dir>/checkpoints`` (none with
            ``save_strategy="no"`` or without ``output_dir``); a rerun resumes from it only with the same recipe
            (``run.record``).
          qlora: a ``gemport.lora.QLoraSpec`` (a QLoRA recipe's 4-bit base, ``QLoraSpec.from_config``): the base
            loads through ``checkpoint.quantize.load_qlora_model`` and LoRA trains on it; default unquantized
            (or the YAML's).
          cache_dir: where the training data is prepared once (tokenized, masked, packed: ``gemport.data.cache``)
            and read from by every later run, resume and process; default ``<output_dir>/gemport-data``, or a
            temporary folder without ``output_dir``.
          progress: show progress bars while the data is prepared.
          abstract: build the model from ``config.json`` alone, shapes only (``run.model.lora_model``: no weight
            is read, nothing allocated), for ``gemport.plan.dry_run``; such a run is compiled, never trained.
            ``train_dataset`` may then be None: one step of full ``max_length`` rows stands for the data.
          kind: what a kind of run takes beside (``DPORun``: ``reference``), passed to its stages.

        Returns:
          The `SFTRun`, its model loaded (or built abstract) on the mesh with LoRA, its data prepared (or read from
          the cache; a stream read as the steps come), its steps' batches built as they are read, and its
          optimizer and ``training_config`` built; ``trainer`` is None until ``train()``.

        Raises:
          RecipeError: a field gemport cannot honour (naming it), no training example left after truncation, or
            ``eval_strategy: steps`` without ``eval_dataset``.
          LoraError, MaskError: a LoRA config or a chat template / record gemport cannot carry.
        """
        recipe = cls.read(sft_config, lora=lora, qlora=qlora, dtype=dtype)
        cls.check(recipe, eval_dataset=eval_dataset, abstract=abstract, **kind)
        base_dir = Path(base_dir)
        spec = GemmaSpec.from_hf(base_dir)
        given = starting_adapter(recipe.lora, init_adapter, base_dir, cls.__name__)
        start = cls.start(recipe, given)
        mesh = mesh if mesh is not None else make_mesh(spec, fsdp=fsdp, tp=tp)
        data = cls.data(recipe, base_dir, spec, mesh, train_dataset, eval_dataset, tokenizer=tokenizer,
                        chat_format=chat_format, cache_dir=cache_dir, progress=progress, abstract=abstract)
        remats = fit_remats(remat_of(recipe.args), spec, _lora_spec(start), mesh.devices.flat[0].platform)
        model = run_model(base_dir, spec, start, mesh=mesh, dtype=recipe.dtype, seed=recipe.fields.seed,
                          remat=remats[0], qlora=recipe.qlora, abstract=abstract)
        if checkpoint_dir is None and not abstract:
            checkpoint_dir = checkpoint_root(recipe.fields)
        num_steps = len(data["train_batches"])
        extras = cls.extras(recipe, given, model, **kind)
        record = recipe_record(recipe.args, base_dir=base_dir, dtype=recipe.dtype, lora_spec=model.lora_spec,
                               qlora=recipe.qlora, examples=cls.recorded_rows(data))
        return cls(args=recipe.args, fields=recipe.fields, base_dir=base_dir, spec=spec, mesh=mesh, model=model,
                   optimizer=hf_optimizer(recipe.args, num_training_steps=num_steps),
                   training_config=training_config(recipe.fields, num_steps, checkpoint_dir=checkpoint_dir,
                                                   evaluate=data["eval_batches"] is not None),
                   record=cls.with_record(record, **kind), remats=remats, **data, **extras)

    @classmethod
    def read(cls, config: Any, *, lora: Any = None, qlora: Any = None, dtype: Any = None) -> RunRecipe:
        """The ``read`` stage: ``config`` (a trainer config, a dict of its fields, or a YAML for ``COMMAND``) read
        once, with the arguments given to ``create`` taking precedence over the YAML's."""
        if isinstance(config, (str, os.PathLike)):
            recipe = read(config, command=cls.COMMAND)
            args = recipe.sft
            lora = lora if lora is not None else recipe.lora()
            qlora = qlora if qlora is not None else recipe.qlora()
            dtype = dtype if dtype is not None else recipe.dtype()
        else:
            args = trainer_fields(config, cls.COMMAND)
        fields = RunFields.from_config(args)
        if dtype is None:
            dtype = jnp.bfloat16 if fields.bf16 else jnp.float32
        return RunRecipe(args=args, fields=fields, lora=lora, qlora=qlora, dtype=dtype)

    @classmethod
    def check(cls, recipe: RunRecipe, *, eval_dataset: Any, abstract: bool, **kind: Any) -> None:
        """The ``check`` stage, before anything long runs: the strategies gemport reproduces, an eval dataset
        where the recipe evaluates (an abstract run is compiled, never evaluated), its trackers installed, and
        bitsandbytes where the 4-bit base's double quantization needs it."""
        check_strategies(recipe.args)
        if not abstract:
            check_eval_split(recipe.fields.eval_strategy, eval_dataset)
        trackers.names(recipe.fields.report_to)
        if recipe.qlora is not None and recipe.qlora.double_quant and not abstract:
            require_double_quant()

    @classmethod
    def start(cls, recipe: RunRecipe, given: LoraSpec | LoraParams) -> LoraSpec | LoraParams:
        """The ``start`` stage: the adapter the model trains from, given the one the recipe names
        (``starting_adapter``): SFT trains it as given."""
        return given

    @classmethod
    def data(cls, recipe: RunRecipe, base_dir: Path, spec: GemmaSpec, mesh, train_dataset: Any, eval_dataset: Any, *,
             tokenizer: Any, chat_format: Any, cache_dir: str | os.PathLike | None, progress: bool,
             abstract: bool) -> dict[str, Any]:
        """The ``data`` stage: the tokenizer, the recipe's pipeline (``from_sft_config``), the training examples
        prepared once into ``cache_root`` (tokenized, masked, packed on every core; under ``jax.distributed`` by
        process 0) and read from disk as batches ask, each optimizer step's batch in HF's order built when read (this
        process's rows of it under ``jax.distributed``), and the eval batches, as the run's attributes; every
        token id checked against the vocabulary (before the model loads)."""
        f = recipe.fields
        if tokenizer is None and abstract and train_dataset is None and not (base_dir / "tokenizer_config.json").is_file():
            # Rows of max_length need no text: Gemma's chat format and pad id 0 stand for the tokenizer's.
            chat_format = chat_format or (Gemma4() if spec.family == "gemma4" else Gemma3())
        else:
            tokenizer = tokenizer or load_tokenizer(base_dir)
            if f.chat_template_path is not None:
                tokenizer = with_chat_template(tokenizer, f.chat_template_path, spec.vocab)
        try:
            pipeline = from_sft_config(recipe.args, tokenizer, chat_format=chat_format)
        except MaskError as e:  # the chat format is read from the template: name the field that set it
            if f.chat_template_path is None:
                raise
            raise RecipeError(f"chat_template_path={str(f.chat_template_path)!r}: {e}") from None
        rows = None
        if jax.process_count() > 1:  # this process's rows of each batch [A, B, T]
            rows = process_rows(batch_sharding(mesh),
                                (f.gradient_accumulation_steps, f.per_device_train_batch_size, 1))
        template = None
        if f.chat_template_path is not None:  # every record checked through it as it is prepared
            template = dict(tokenizer=tokenizer, chat_format=pipeline.chat_format, policy=pipeline.policy,
                            text_field=pipeline.text_field)
        if abstract and train_dataset is None:
            examples, report, plan, steps = [], TruncationReport(), [], [_full_rows(pipeline, f, rows)]
        elif streamed(train_dataset):
            if template is not None:  # a stream is checked on the records its first packing batch holds
                check_records(itertools.islice(records(train_dataset), TRL_PACKING_BATCH), **template)
            steps = StreamBatches(pipeline, train_dataset, tokenizer, part=rows)
            examples, report, plan = steps.head, steps.report, steps.plan
        else:
            prepared = _prepared(pipeline, train_dataset, tokenizer, cache_root(f, cache_dir), template, progress)
            examples, report = prepared.examples, prepared.report
            if not len(examples):
                raise RecipeError(f"no training example is left after truncation at max_length "
                                  f"{pipeline.max_length} ({report}); raise max_length")
            steps = pipeline.steps(examples, placement=prepared.placement, rows=rows)
            plan = steps.plan
        held_out = None
        if eval_dataset is not None:
            held_out, _ = pipeline.examples(eval_dataset, tokenizer, progress=progress)
        check_token_ids(examples, spec.vocab, tokenizer, pad_id=pipeline.pad_id)
        check_token_ids(held_out or [], spec.vocab, tokenizer, split="eval")
        evals = None
        if held_out:
            evals = eval_batches(held_out, f.per_device_eval_batch_size, pad_id=pipeline.pad_id,
                                 pad_to_multiple_of=pipeline.pad_to_multiple_of,
                                 drop_last=bool(f.dataloader_drop_last))
            if jax.process_count() > 1:  # the eval set is small: laid out whole, each process keeps its rows
                mine = process_rows(batch_sharding(mesh), evals[0]["tokens"].shape)
                evals = [{k: v[:, mine] for k, v in b.items()} for b in evals]
        return dict(tokenizer=tokenizer, pipeline=pipeline, examples=examples, report=report, plan=plan,
                    train_batches=steps, eval_examples=held_out, eval_batches=evals)

    @classmethod
    def extras(cls, recipe: RunRecipe, given: LoraSpec | LoraParams, model: nnx.Module, **kind: Any) -> dict[str, Any]:
        """The attributes a kind of run adds, once its model is built: none for SFT."""
        return {}

    @classmethod
    def recorded_rows(cls, data: Mapping[str, Any]) -> Sequence[Any]:
        """What the ``record`` stage hashes as the data trained (``run.record.data_hash``): the examples."""
        return data["examples"]

    @classmethod
    def with_record(cls, record: dict[str, Any], **kind: Any) -> dict[str, Any]:
        """The ``record`` stage's last word: the entries a kind of run adds (none for SFT)."""
        return record

    @property
    def lora_spec(self) -> LoraSpec:
        """The LoRA spec the model carries."""
        return self.model.lora_spec

    @property
    def precision(self) -> Precision:
        """The precision of the step's products the recipe describes (``step.precision.matmul_precision``:
        float32 products for a float32 recipe, ``"high"`` with ``tf32``, one bfloat16 pass for a bfloat16
        recipe)."""
        return matmul_precision(self.fields.bf16, self.fields.tf32)

    @property
    def max_steps(self) -> int:
        """Optimizer steps of the run (HF's ``max_steps``, or its epochs over the data)."""
        return len(self.train_batches)

    @property
    def num_parameters(self) -> int:
        """The model's parameters, LoRA factors included (what HF's ``model.num_parameters()`` counts: PEFT's
        factors, without the zero padding and zero slots that Tunix's fused modules hold, `LoraLayout.num_params`)."""

        base = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))
        return (sum(int(np.size(v)) for v in jax.tree.leaves(nnx.state(self.model, base)))
                + LoraLayout(self.spec, self.lora_spec).num_params)

    @property
    def num_units(self) -> int:
        """The rows HF's sampler orders: packed rows (``packing``), else examples."""
        return self.plan.num_samples

    def make_trainer(self, **kwargs: Any):
        """An ``HFPeftTrainer`` of the current ``model``, ``optimizer`` and ``training_config`` (on the mesh,
        which Tunix reads when it shards the optimizer). With checkpoints in its root it resumes from the latest.
        LoRA dropout draws from the recipe's ``seed``. ``kwargs`` go to the trainer (``metrics_logger``, ...)."""
        with self._trainer_placement():
            return HFPeftTrainer(self.model, self.optimizer.tx, self.training_config, lora_spec=self.lora_spec,
                                 seed=self.fields.seed, precision=self.precision, remats=self.remats, **kwargs)

    def _trainer_placement(self):
        # An abstract run's trainer starts its optimizer state off the mesh, whose devices may be compile-only (a
        # TPU slice's); gemport.plan lowers its step with the state placed on the mesh.


        abstract = any(isinstance(v, jax.ShapeDtypeStruct) for v in jax.tree.leaves(nnx.state(self.model)))
        return contextlib.nullcontext() if abstract else use_mesh(self.mesh)

    def train(self, hooks: Any = None) -> Any:
        """Train on ``train_batches`` (evaluating on ``eval_batches``) inside the mesh context; returns the trainer.

        hooks: Tunix ``TrainingHooks``; default, with an ``output_dir``, ``gemport.run.outputs.HFOutputs``
        (``trainer_state.json``, TensorBoard per ``report_to``, a progress bar; process 0 writes them). Builds
        ``trainer`` first if unset, with checkpoints watching for SIGTERM (``run.preemption.Preemption``):
        then the run saves the checkpoint of the step it reaches and raises ``Preempted``. Resumes from the
        latest checkpoint in the checkpoint root, exactly (Tunix skips the consumed micro-batches, and the data
        is the same in the same order), when they trained this recipe (``record``, recorded beside them); a
        changed recipe raises ``RecipeError`` naming what changed, unless ``resume_from_checkpoint`` is set.
        """
        f = self.fields
        root = self.training_config.checkpoint_root_directory
        if self.trainer is None and root is not None and self.record is not None:
            check_resume(root, self.record,
                         explicit=f.resume_from_checkpoint not in (None, False, "", "false", "False"))
        output_dir = f.output_dir
        if output_dir is not None and jax.process_index() == 0:
            claim_output(output_dir)  # one run per output_dir
        if hooks is None and output_dir is not None:
            hooks = HFOutputs(
                output_dir, self.args, epochs=step_epochs(self.plan, self.num_units, self.args),
                tokens=step_tokens(self.train_batches), eval_every=self.training_config.eval_every_n_steps,
                learning_rate=self.optimizer.schedule,
                tracker_config=dict(base_dir=self.base_dir, lora_config=self.lora_spec.to_peft(str(self.base_dir)),
                                    num_parameters=self.num_parameters), command=self.COMMAND)
        preemption = None
        if self.trainer is None:
            if root is not None:
                preemption = Preemption()
            self.trainer = self.make_trainer(preemption=preemption)
        if hooks is not None:
            self.trainer.with_training_hooks(hooks)
        # Tunix passes over the micro-batches its checkpoint consumed: they are not built. One thread builds the
        # next step's micro-batches while the device runs this one.
        accumulation = self.training_config.gradient_accumulation_steps
        train_ds = prefetched(self.micro_batches(self.train_batches, skip=self.trainer.train_steps * accumulation),
                              2 * accumulation)
        eval_ds = self.micro_batches(self.eval_batches) if self.eval_batches else None
        try:
            with use_mesh(self.mesh):
                self.trainer.train(train_ds, eval_ds)
        finally:
            if isinstance(hooks, HFOutputs):
                hooks.finish()
            if preemption is not None:
                preemption.close()
        return self.trainer

    def micro_batches(self, steps: Sequence[Mapping[str, np.ndarray]] | StepBatches | StreamBatches, *,
                      skip: int = 0) -> Any:
        """The trainer's dataset of ``steps`` (``train_batches`` or ``eval_batches``), its first ``skip``
        micro-batches not built: ``run.trainer.micro_batches``."""
        return micro_batches(steps, skip=skip)

    def lora_params(self) -> LoraParams:
        """The trained factors on the host, with their spec. Under ``jax.distributed`` every process must call
        it (the factors are gathered from all of them)."""

        flat = flat_params(self.model, nnx.LoRAParam)
        if jax.process_count() > 1:
            flat = multihost_utils.process_allgather(flat, tiled=True)
        return load_lora(flat, lora_spec=self.lora_spec)

    def export_peft(self, out_dir: str | os.PathLike, **kwargs: Any) -> Path:
        """The trained adapter as PEFT files (``checkpoint.export_peft`` of ``lora_params()`` on ``base_dir``).
        Under ``jax.distributed`` every process calls it and process 0 writes."""
        lora = self.lora_params()
        return export_peft(lora, out_dir, base_dir=self.base_dir, **kwargs) if jax.process_index() == 0 \
            else Path(out_dir)

    def export_merged(self, out_dir: str | os.PathLike, **kwargs: Any) -> Path:
        """The base with the trained adapter merged in (``checkpoint.export_merged``), for vLLM; under
        ``jax.distributed`` as ``export_peft``."""
        lora = self.lora_params()
        return export_merged(lora, out_dir, base_dir=self.base_dir, **kwargs) if jax.process_index() == 0 \
            else Path(out_dir)


def checkpoint_root(config: RunFields | Any) -> Path | None:
    """The Orbax checkpoint root of a recipe (its ``RunFields``, or a config they are read from):
    ``<output_dir>/checkpoints``, or None without ``output_dir`` or with ``save_strategy="no"``."""
    f = run_fields(config)
    return None if f.output_dir is None or f.save_strategy == "no" else Path(f.output_dir) / CHECKPOINTS


DATA_CACHE = "gemport-data"
"""The prepared-data cache inside ``output_dir`` (``<output_dir>/gemport-data/<key>/``: ``gemport.data.cache``)."""


def cache_root(config: RunFields | Any, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where a run keeps its prepared data: ``cache_dir`` when given, else ``<output_dir>/gemport-data``, else (no
    ``output_dir``) a temporary folder of this process, removed when it exits."""
    if cache_dir is not None:
        return Path(cache_dir)
    f = run_fields(config)
    if f.output_dir is not None:
        return Path(f.output_dir) / DATA_CACHE
    return _scratch()


@functools.cache
def _scratch() -> Path:
    path = Path(tempfile.mkdtemp(prefix="gemport-data-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def _prepared(pipeline: SFTPipeline, source: Any, tokenizer: Any, root: Path, template: Mapping[str, Any] | None,
              progress: bool) -> Prepared:
    # Under jax.distributed process 0 prepares while the others wait, then every process reads the preparation;
    # one whose cache is not on storage process 0 shares prepares its own.
    if jax.process_count() > 1:
        if jax.process_index() == 0:
            pipeline.prepared(source, tokenizer, root=root, template=template, progress=progress)
        multihost_utils.sync_global_devices("gemport: training data prepared")
    return pipeline.prepared(source, tokenizer, root=root, template=template,
                             progress=progress and jax.process_index() == 0)


def run_model(base_dir: Path, spec: GemmaSpec, start: LoraSpec | LoraParams, *, mesh, dtype: Any, seed: int,
              remat: str, qlora: QLoraSpec | None = None, abstract: bool = False):
    """A run's model: the base of ``base_dir`` placed on ``mesh`` in ``dtype`` (4-bit with ``qlora``:
    ``checkpoint.quantize.load_qlora_model``), with LoRA from ``start`` (``starting_adapter``; a fresh adapter
    initialised from ``seed``) and decoder remat ``remat`` (``step.remat.set_remat``). ``abstract``: shapes only,
    from ``spec`` (``run.model.lora_model``: no weight read), for ``gemport.plan.dry_run``."""
    if abstract:
        return lora_model(spec, _lora_spec(start), param_dtype=dtype, remat=remat, qlora=qlora)
    with use_mesh(mesh):
        if qlora is None:
            base = load_model(base_dir, spec=spec, mesh=mesh, param_dtype=dtype)
        else:
            base = load_qlora_model(base_dir, qlora, spec=spec, mesh=mesh, compute_dtype=dtype)
        model = apply_lora(base, spec, start, seed=seed, qlora=qlora)
    set_remat(model, remat)
    return model


def _lora_spec(start: LoraSpec | LoraParams) -> LoraSpec:
    return start if isinstance(start, LoraSpec) else start.lora_spec


def starting_adapter(lora: Any, init_adapter: str | os.PathLike | None, base_dir: Path,
                     who: str) -> LoraSpec | LoraParams:
    """What a run's LoRA starts from: ``init_adapter``'s imported factors (a PEFT adapter folder), else a fresh
    ``LoraSpec`` of ``lora`` (a LoraConfig, adapter_config.json or lora_* fields; PEFT's default targets where it
    leaves them unset). Raises ``LoraError`` when both are given and differ, or neither is; ``who`` names the
    caller in the message."""
    if lora is not None:
        lora = with_peft_targets(lora, base_dir)
    if init_adapter is not None:
        start = import_peft(init_adapter, base_dir=base_dir)
        if lora is not None and lora_spec_of(lora) != start.lora_spec:
            raise LoraError(f"{init_adapter}: its adapter_config.json ({start.lora_spec}) differs from the "
                            f"LoRA config given ({lora_spec_of(lora)}); pass one of them")
        return start
    if lora is None:
        raise LoraError(f"{who}: no LoRA config; pass lora= (a LoraConfig, adapter_config.json or lora_* fields) "
                        "or init_adapter=")
    return lora_spec_of(lora)


def with_peft_targets(lora: Any, base_dir: Path) -> Any:
    """``lora`` with PEFT's per-architecture ``target_modules`` (``lora.peft_default_targets`` of the base's
    ``model_type``) where a LoraConfig or its dict leaves them unset. Raises ``LoraError`` naming
    ``lora_target_modules`` where PEFT has no default."""

    unset = lora.get("target_modules") is None if isinstance(lora, Mapping) else (
        not isinstance(lora, (LoraSpec, str, os.PathLike)) and getattr(lora, "target_modules", ...) is None)
    if not unset:
        return lora
    model_type = json.loads((base_dir / "config.json").read_text())["model_type"]
    parameters = (lora.get("target_parameters") if isinstance(lora, Mapping)
                  else getattr(lora, "target_parameters", None))
    try:
        targets = list(peft_default_targets(model_type))
    except LoraError:
        if not parameters:
            raise
        targets = []  # PEFT adapts only the target_parameters where it has no default for model_type
    if isinstance(lora, Mapping):
        lora = {**lora, "target_modules": targets}
    else:
        lora = copy.copy(lora)
        lora.target_modules = targets
    return lora


def _full_rows(pipeline: SFTPipeline, f: Mapping[str, Any], rows: slice | None) -> dict[str, np.ndarray]:
    # A step of the recipe's shape [A, B, max_length] standing for data not at hand: every row one whole-row
    # example, every token but the first a target (the most a step computes).
    if pipeline.max_length is None:
        raise RecipeError("SFTConfig.max_length is None: without data the rows' length is unknown; set max_length "
                          "or give the data")
    count = 1 if pipeline.layout == "padding_free" else f.per_device_train_batch_size
    if rows is not None:
        count = len(range(count)[rows])
    shape = (f.gradient_accumulation_steps, count, pipeline.max_length)
    return {"tokens": np.zeros(shape, np.int32), "loss_mask": np.ones(shape, bool),
            "segment_ids": np.ones(shape, np.int32),
            "positions": np.broadcast_to(np.arange(shape[-1], dtype=np.int32), shape).copy()}


def training_config(config: RunFields | Any, max_steps: int, *, checkpoint_dir: str | os.PathLike | None = None,
                    evaluate: bool = False) -> TrainingConfig:
    """Tunix's ``TrainingConfig`` for ``max_steps`` optimizer steps of a recipe (its ``RunFields``, or a config
    they are read from).

    ``gradient_accumulation_steps`` as given; evaluation every ``eval_steps`` (default ``logging_steps``, as HF)
    when ``evaluate`` and ``eval_strategy="steps"`` (``"epoch"`` is refused; ``"no"``: never); checkpoints in
    ``checkpoint_dir`` every ``save_steps``, keeping ``save_total_limit``. Tunix's own progress bar is off.
    """

    f = run_fields(config)
    check_strategies(dataclasses.asdict(f))
    eval_every = max_steps + 1
    if evaluate and f.eval_strategy == "steps":
        eval_every = steps_of(f.eval_steps or f.logging_steps, max_steps, "eval_steps")
    options = None
    if checkpoint_dir is not None:
        options = ocp.CheckpointManagerOptions(save_interval_steps=steps_of(f.save_steps, max_steps, "save_steps"),
                                               max_to_keep=f.save_total_limit)
    return TrainingConfig(eval_every_n_steps=eval_every, max_steps=max_steps,
                          gradient_accumulation_steps=f.gradient_accumulation_steps,
                          checkpoint_root_directory=None if checkpoint_dir is None else str(checkpoint_dir),
                          checkpointing_options=options, pbar_description=None, max_inflight_computations=1)


__all__ = ["CHECKPOINTS", "SFTRun", "check_eval_split", "checkpoint_root", "eval_batches", "eval_cuts", "load_tokenizer", "lora_spec_of",
           "RunRecipe", "sft_fields", "starting_adapter", "training_config", "with_peft_targets"]
