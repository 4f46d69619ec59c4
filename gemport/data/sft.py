"""TRL's ``SFTConfig`` mapped onto gemport.data in one call: formats, masks, truncation and batch layout."""

import dataclasses
import math
import os
import typing
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from gemport.errors import RecipeError
from gemport.data import cache, dataset
from gemport.data.flat import FlatExamples
from gemport.data.gemma3 import Gemma3
from gemport.data.gemma4 import Gemma4
from gemport.data.order import OptimizerStep, StepPlan
from gemport.data.packing import Placement, Rows, check_packable, packed_rows, trl_placement
from gemport.data.policies import MaskPolicy
from gemport.data.prepared import Prepared
from gemport.data.steps import Layout, StepBatches
from gemport.data.tokenize import Example
from gemport.data.truncation import Truncation, TruncationReport
from gemport.recipe import DataFields
from gemport.data.template import chat_format as from_tokenizer

LAYOUTS: tuple[Layout, ...] = typing.get_args(Layout)
"""Every ``Layout``."""


@dataclasses.dataclass(frozen=True)
class SFTPipeline:
    """What an ``SFTConfig`` asks of the data, as gemport.data arguments; built by ``from_sft_config``.

    chat_format: ``Gemma3()`` / ``Gemma4(...)``, or None for a tokenizer without a chat template (text and
    prompt/completion strings, which TRL tokenizes without one; conversations are refused); policy: ``MaskPolicy("assistant")`` for
    ``assistant_only_loss``, else None (every token trained, as TRL does); truncation: ``Truncation``
    at ``max_length``; completion_only_loss, text_field, eos_token: ``gemport.data.formats.render``'s arguments;
    layout: one of ``LAYOUTS``; max_length, pad_to_multiple_of, pad_id: the row geometry;
    config: the ``SFTConfig`` (or dict) the sample order and batch sizes are read from; num_proc:
    ``dataset_num_proc``, the shards TRL packs each of (``packing.trl_placement``);
    remat: Tunix's ``remat_config`` for ``gradient_checkpointing`` (``remat_of``: ``"decoder"``, every decoder
    layer recomputed in the backward pass, as HF's checkpointing of each layer; ``"none"``), which ``SFTRun``
    sets on its model (``step.remat.set_remat``).
    """

    chat_format: Gemma3 | Gemma4 | None
    policy: MaskPolicy | None
    truncation: Truncation
    completion_only_loss: bool | None
    text_field: str
    eos_token: str | None
    layout: Layout
    max_length: int | None
    pad_to_multiple_of: int | None
    pad_id: int
    config: Any
    remat: str = "none"
    num_proc: int | None = None

    def examples(self, source: Any, tokenizer: Any, **kwargs: Any) -> tuple[list[Example], TruncationReport]:
        """``gemport.data.dataset.examples`` of ``source`` with this pipeline's arguments: (examples, report).

        ``source`` is a TRL dataset in any of its formats (messages, prompt/completion, text) or a
        file of one; ``kwargs`` go to ``dataset.examples`` (``check``, ``progress``, ...).
        """
        return dataset.examples(
            source, tokenizer, self.chat_format, self.truncation, policy=self.policy,
            completion_only_loss=self.completion_only_loss, text_field=self.text_field,
            eos_token=self.eos_token, **kwargs,
        )

    def prepared(self, source: Any, tokenizer: Any, *, root: str | os.PathLike, workers: int | None = None,
                 template: Mapping[str, Any] | None = None, progress: bool = True) -> Prepared:
        """The examples of ``source`` (with ``packing``, their packed rows) prepared once into ``root`` and read
        from there as batches ask: ``gemport.data.cache.prepared`` with this pipeline (its ``workers``,
        ``template`` check and ``progress``)."""
        return cache.prepared(self, source, tokenizer, root=root, workers=workers, template=template,
                              progress=progress)

    def placement(self, examples: FlatExamples) -> Placement:
        """TRL's packed rows of ``examples`` (``layout="pack"``): ``packing.trl_placement`` at ``max_length``, in
        ``dataset_num_proc`` shards. Raises MaskError for an example packing cannot take."""
        lengths = examples.lengths
        first_trained = np.zeros(len(lengths), bool)
        first_trained[lengths > 0] = examples.loss_mask[examples.offsets[:-1][lengths > 0]]
        check_packable(lengths, first_trained, self.max_length, "pack")
        return trl_placement(lengths, self.max_length, num_proc=self.num_proc)

    def units(self, examples: Sequence[Example] | FlatExamples) -> Rows | Sequence[Example]:
        """What HF's sampler orders: for ``layout="pack"`` TRL's packed ``Rows`` [rows, max_length]
        (``placement``), else the examples."""
        if self.layout != "pack":
            return examples
        flat = examples if isinstance(examples, FlatExamples) else FlatExamples.of(examples)
        placement = self.placement(flat)
        return packed_rows(flat, placement, np.arange(placement.rows), self.max_length)

    def steps(self, examples: FlatExamples, *, placement: Placement | None = None,
              rows: slice | None = None) -> StepBatches:
        """Every optimizer step of HF's Trainer on ``examples``, each batch built when read: a ``StepBatches``
        over the units (``placement``'s rows for ``layout="pack"``, computed unless given; else the examples)
        in HF's order (``order.StepPlan`` of ``config``).

        Each micro-batch is laid out per ``layout`` and the step's batch is [gradient_accumulation_steps, rows, T].
        T is fixed for the whole run, so the step compiles once: ``max_length`` (packed), the longest example
        (padded) or the longest micro-batch (padding-free), rounded up to ``pad_to_multiple_of``.

        rows: only these rows of every batch (``data.distributed.process_rows``), laid out by this process under
        ``jax.distributed`` (``StepBatches``' ``part``). T still depends on every example's length (and packing
        on all of them), so ``examples`` is the whole dataset. Not for ``padding_free``, whose batch is one row.
        """
        if self.layout == "pack" and placement is None:
            placement = self.placement(examples)
        units = placement.rows if self.layout == "pack" else len(examples)
        plan = StepPlan(self.config, units)
        f = DataFields.from_config(self.config)
        multiple = self.pad_to_multiple_of or 1
        if self.layout == "pack":
            width = self.max_length
        elif self.layout == "pad":
            width = math.ceil(int(examples.lengths.max()) / multiple) * multiple
        else:
            width = math.ceil(plan.largest(examples.lengths) / multiple) * multiple
        return StepBatches(examples, plan, layout=self.layout, width=width,
                           accumulation=f.gradient_accumulation_steps, batch_size=f.per_device_train_batch_size,
                           pad_id=self.pad_id, placement=placement, part=rows)

    def batches(self, examples: Sequence[Example], *,
                rows: slice | None = None) -> Iterator[tuple[OptimizerStep, dict[str, np.ndarray]]]:
        """Yields ``(OptimizerStep, batch)`` for every optimizer step of HF's Trainer on ``examples``: the steps of
        ``steps`` (its layout, T and ``rows``), each ``OptimizerStep`` cut to ``rows`` (``process_step``)."""
        steps = self.steps(examples if isinstance(examples, FlatExamples) else FlatExamples.of(examples), rows=rows)
        for s in range(len(steps)):
            yield steps.step(s), steps[s]


def remat_of(config: Any) -> str:
    """Tunix's ``remat_config`` for an ``SFTConfig``'s ``gradient_checkpointing``, as HF checkpoints: True (TRL's
    default) -> ``"decoder"``, every decoder layer recomputed in the backward pass (on Gemma 4 by
    ``step.remat.tied_remat_model``, one layer's backward live at a time; on Gemma 3 by Tunix's ``nnx.remat``);
    False -> ``"none"``.

    ``gradient_checkpointing_kwargs``: ``use_reentrant`` (torch's choice between two implementations of the same
    recomputation) has no JAX counterpart and changes nothing; any other key raises RecipeError naming it.
    """
    f = DataFields.from_config(config)
    for key in f.gradient_checkpointing_kwargs or {}:
        if key != "use_reentrant":
            raise RecipeError(
                f"SFTConfig.gradient_checkpointing_kwargs[{key!r}] has no counterpart in gemport's decoder remat; "
                "remove it (only use_reentrant is accepted, and it changes nothing in JAX)"
            )
    return "decoder" if f.gradient_checkpointing else "none"


def from_sft_config(config: Any, tokenizer: Any, *, chat_format: Gemma3 | Gemma4 | None = None) -> SFTPipeline:
    """Map TRL's ``SFTConfig`` (or ``TrainingArguments``, or a dict of their fields) onto gemport.data.

    The fields read are ``gemport.recipe.DataFields`` (``DataFields.from_config``: absent ones at TRL's ``SFTConfig``
    defaults).

    Reads the masks, ``max_length``, the packing layout, the text field and special tokens, and the batch sizes
    and sample order through ``optimizer_steps``. Where it differs from TRL, and what becomes of the GPU
    recipe's speed settings: see docs/sft.md#where-the-data-differs-from-trl.

    Args:
      config: ``SFTConfig``, ``TrainingArguments`` or a dict of their fields; kept as the pipeline's ``config``,
        from which `SFTPipeline.batches` reads the batch sizes and the sample order.
      tokenizer: the HF tokenizer the data is tokenized with: its chat template gives the default
        ``chat_format``, its ``pad_token`` (or ``eos_token``) the pad id unless the config sets ``pad_token``.
      chat_format: default ``data.template.chat_format(tokenizer)``, or None for a tokenizer without a chat
        template (text and prompt/completion strings only); pass ``chat_format(tokenizer, thinking="on")`` for
        Gemma 4 with thinking.

    Returns:
      An `SFTPipeline`: ``examples(records, tokenizer)`` tokenizes and masks TRL records into ``(examples,
      TruncationReport)`` (each `Example`'s tokens int32 [n] and loss_mask bool [n]), ``batches(examples)``
      yields every optimizer step of HF's Trainer as ``(OptimizerStep, batch)`` with ``BATCH_FIELDS``
      [gradient_accumulation_steps, rows, T] for `train_step`; ``remat`` is the model's remat for
      ``gradient_checkpointing``.

    Raises:
      RecipeError: a setting gemport does not reproduce (``truncation_mode="keep_end"``, ``packing_strategy``
        other than ``"bfd"``, ``loss_type="dft"``, ``shuffle_dataset=True``), ``packing`` without ``max_length``, an
        ``eos_token`` the vocabulary lacks, or a ``gradient_checkpointing_kwargs`` key other than
        ``use_reentrant``.

    Example (``tokenizer``: a Gemma 4 tokenizer whose chat template marks the generated turns, e.g. the tiny
    one-token-per-character tokenizer the tests build):

      >>> from gemport import from_sft_config
      >>> pipeline = from_sft_config({"assistant_only_loss": True, "packing": True, "max_length": 64,
      ...                             "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}, tokenizer)
      >>> pipeline.layout, pipeline.remat, pipeline.policy
      ('pack', 'decoder', MaskPolicy(train='assistant', reasoning=False))
      >>> records = [{"messages": [{"role": "user", "content": f"Say {word}."}, {"role": "assistant", "content": word}]}
      ...            for word in ("alpha", "beta", "gamma", "delta", "eps", "zeta")]
      >>> examples, report = pipeline.examples(records, tokenizer, progress=False)
      >>> first = examples[0]  # only the assistant's answer and its end of turn are trained
      >>> tokenizer.convert_ids_to_tokens(first.tokens[first.loss_mask])[:6]
      ['a', 'l', 'p', 'h', 'a', '<turn|>']
      >>> # 6 examples packed into 3 rows of 64; TRL's default 3 epochs, each one step of 2 micro-batches of 2 rows
      >>> [(step.step, step.epoch, batch["tokens"].shape) for step, batch in pipeline.batches(examples)]
      [(0, 0, (2, 2, 64)), (1, 1, (2, 2, 64)), (2, 2, (2, 2, 64))]
    """
    f = DataFields.from_config(config)
    refused = {
        "truncation_mode": (f.truncation_mode != "keep_start", "keep 'keep_start'"),
        "packing_strategy": (f.packing and f.packing_strategy != "bfd",
                             "use 'bfd' (best fit decreasing, as data.pack)"),
        "loss_type": (f.loss_type != "nll", "use 'nll'"),
        "shuffle_dataset": (bool(f.shuffle_dataset), "leave it False; the trainer's sampler shuffles"),
    }
    for name, (bad, fix) in refused.items():
        if bad:
            raise RecipeError(f"SFTConfig.{name}={getattr(f, name)!r} is not reproduced by gemport; {fix}")
    max_length = f.max_length
    if f.packing and max_length is None:
        raise RecipeError("SFTConfig.packing needs max_length, as in TRL")
    if chat_format is None and getattr(tokenizer, "chat_template", None):
        chat_format = from_tokenizer(tokenizer)
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else None
    if f.eos_token is not None and vocab is not None and f.eos_token not in vocab:  # as TRL raises
        raise RecipeError(f"SFTConfig.eos_token={f.eos_token!r} is not in the tokenizer's vocabulary; give a "
                          "token it has (e.g. '<end_of_turn>' for Gemma 3, '<turn|>' for Gemma 4)")
    pad_token = f.pad_token or getattr(tokenizer, "pad_token", None) or getattr(tokenizer, "eos_token", None)
    pad_id = int(tokenizer.convert_tokens_to_ids(pad_token)) if pad_token is not None else 0
    layout = "pack" if f.packing else "padding_free" if f.padding_free else "pad"
    return SFTPipeline(
        chat_format=chat_format,
        policy=MaskPolicy("assistant") if f.assistant_only_loss else None,
        truncation=Truncation(max_len=max_length if max_length is not None else 2**62, overflow="trim"),
        completion_only_loss=f.completion_only_loss,
        text_field=f.dataset_text_field,
        eos_token=f.eos_token,
        layout=layout,
        max_length=max_length,
        pad_to_multiple_of=f.pad_to_multiple_of,
        pad_id=pad_id,
        config=config,
        remat=remat_of(config),
        num_proc=f.dataset_num_proc,
    )
