"""The data stage: TRL's records -> rendered, masked, tokenized, fitted examples -> each step's rows.

Render a conversation in the Gemma 3 or Gemma 4 chat format (``Gemma3``, ``Gemma4``), decide which segments are
trained (``MaskPolicy``), carry that to tokens through character offsets (``encode``), fit to a length without
teaching the wrong thing (``Truncation``, ``truncate``), pack best fit decreasing (``pack``) or batch without
packing (``pad``, ``padding_free``) into ``Rows``, lay micro-batches out as a step's batch (``stack``), and feed Tunix (``tunix_inputs``). ``from_sft_config`` maps a
TRL ``SFTConfig`` onto these pieces (``SFTPipeline``); ``optimizer_steps`` gives each optimizer step's rows in
HF's sample order (torch's seeded ``RandomSampler``, reproduced without torch). DPO's preference pairs:
``preferences`` and ``collate``. Grain integration is in ``gemport.data.grain``. Options are ``Literal`` types:
``Train``, ``Overflow``, ``Thinking``, ``Revision``, a truncation's ``Decision``, ``Layout``, ``SamplingStrategy``.
"""

from gemport.data.batching import BATCH_FIELDS, pad, padding_free, stack
from gemport.data.gemma3 import Gemma3
from gemport.data.gemma4 import Gemma4, Revision, Thinking
from gemport.data.order import optimizer_steps, OptimizerStep, randperm, sample_order, SamplingStrategy
from gemport.data.packing import attention_mask, Labelled, pack, Rows, tunix_inputs
from gemport.data.pipeline import build, prepare
from gemport.data.policies import MaskPolicy, Train
from gemport.data.pairs import collate, Preference, preferences, split_prompt
from gemport.data.render import Part, PARTS, Role, ROLES, Segment
from gemport.data.sft import from_sft_config, Layout, LAYOUTS, SFTPipeline
from gemport.data.tokenize import check_tokenizer, encode, Example, token_offsets
from gemport.data.truncation import Decision, Fitted, Overflow, truncate, Truncation, TruncationReport

__all__ = [
    "BATCH_FIELDS",
    "Decision",
    "Example",
    "Fitted",
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
    "Preference",
    "ROLES",
    "Revision",
    "Role",
    "Rows",
    "SFTPipeline",
    "SamplingStrategy",
    "Segment",
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
    "truncate",
    "tunix_inputs",
]
