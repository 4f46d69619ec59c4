"""The data stage: TRL's records -> rendered, masked, tokenized, fitted examples -> each step's rows.

Render a conversation in the Gemma 3 or Gemma 4 chat format (``Gemma3``, ``Gemma4``), decide which segments are
trained (``MaskPolicy``), carry that to tokens through character offsets (``encode``), fit to a length without
teaching the wrong thing (``Truncation``, ``truncate``), pack best fit decreasing (``pack``) or batch without
packing (``pad``, ``padding_free``) into ``Rows``, lay micro-batches out as a step's batch (``stack``), and feed Tunix (``tunix_inputs``). ``from_sft_config`` maps a
TRL ``SFTConfig`` onto these pieces (``SFTPipeline``); ``optimizer_steps`` gives each optimizer step's rows in
HF's sample order (torch's seeded ``RandomSampler``, reproduced without torch). DPO's preference pairs:
``preferences`` and ``collate``. Grain integration is in ``gemport.data.grain``. At scale: ``SFTPipeline.prepared``
writes the examples (and TRL's packed rows, ``trl_placement``: 1000 examples at a time) once, on every core, into a
cache read back by range (``FlatExamples``, ``gemport.data.cache``); ``SFTPipeline.steps`` is the sequence of
every step's batch built when read (``StepBatches`` over a ``StepPlan``); a dataset without a length (a
``Stream``, an ``IterableDataset``) is read as TRL reads a stream (``StreamBatches``). Options are ``Literal`` types:
``Train``, ``Overflow``, ``Thinking``, ``Revision``, a truncation's ``Decision``, ``Layout``, ``SamplingStrategy``.
"""

from gemport.data.batching import BATCH_FIELDS, pad, padding_free, stack
from gemport.data.flat import FlatExamples
from gemport.data.gemma3 import Gemma3
from gemport.data.gemma4 import Gemma4, Revision, Thinking
from gemport.data.order import optimizer_steps, OptimizerStep, randperm, sample_order, SamplingStrategy, StepPlan
from gemport.data.packing import attention_mask, Labelled, pack, Placement, Rows, trl_placement, tunix_inputs
from gemport.data.pipeline import build, prepare
from gemport.data.policies import MaskPolicy, Train
from gemport.data.pairs import collate, Preference, preferences, split_prompt
from gemport.data.render import Part, PARTS, Role, ROLES, Segment
from gemport.data.sft import from_sft_config, Layout, LAYOUTS, SFTPipeline
from gemport.data.steps import StepBatches
from gemport.data.stream import Stream, StreamBatches
from gemport.data.tokenize import check_tokenizer, encode, Example, token_offsets
from gemport.data.truncation import Decision, Fitted, Overflow, truncate, Truncation, TruncationReport

__all__ = [
    "BATCH_FIELDS",
    "Decision",
    "Example",
    "Fitted",
    "FlatExamples",
    "Gemma3",
    "Gemma4",
    "LAYOUTS",
    "Labelled",
    "Layout",
    "MaskPolicy",
    "OptimizerStep",
    "Overflow",
    "PARTS",
    "Part",
    "Placement",
    "Preference",
    "ROLES",
    "Revision",
    "Role",
    "Rows",
    "SFTPipeline",
    "SamplingStrategy",
    "Segment",
    "StepBatches",
    "StepPlan",
    "Stream",
    "StreamBatches",
    "Thinking",
    "Train",
    "Truncation",
    "TruncationReport",
    "attention_mask",
    "build",
    "check_tokenizer",
    "collate",
    "encode",
    "from_sft_config",
    "optimizer_steps",
    "pack",
    "pad",
    "padding_free",
    "preferences",
    "prepare",
    "randperm",
    "sample_order",
    "split_prompt",
    "stack",
    "token_offsets",
    "trl_placement",
    "truncate",
    "tunix_inputs",
]
