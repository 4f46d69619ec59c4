"""Loss masks and packing for Gemma chat data.

Render a conversation in the Gemma 3 or Gemma 4 chat format (``Gemma3``, ``Gemma4``), decide which
segments are trained (``MaskPolicy``), carry that to tokens through character offsets
(``encode``), fit to a length without teaching the wrong thing (``Truncation``, ``truncate``),
pack best fit decreasing (``pack``) or batch without packing (``pad``, ``padding_free``) into ``Rows`` and feed
Tunix (``tunix_inputs``), with a loss whose scope is explicit (``masked_cross_entropy``,
``loss_scopes``). Grain integration is in ``gemport.masks.grain``. Options are ``Literal`` types:
``Train``, ``Overflow``, ``Thinking``, ``Revision``, and a truncation's ``Decision``.
"""

from gemport.masks.batching import pad, padding_free
from gemport.masks.gemma3 import Gemma3
from gemport.masks.gemma4 import Gemma4, Revision, Thinking
from gemport.masks.loss import loss_scopes, masked_cross_entropy, summed_cross_entropy
from gemport.masks.packing import Labelled, Rows, attention_mask, pack, tunix_inputs
from gemport.masks.pipeline import build, prepare
from gemport.masks.policies import MaskPolicy, Train
from gemport.masks.render import PARTS, ROLES, Part, Role, Segment
from gemport.masks.tokenize import Example, check_tokenizer, encode, token_offsets
from gemport.masks.truncation import Decision, Fitted, Overflow, Truncation, TruncationReport, truncate

__all__ = [
    "PARTS",
    "ROLES",
    "Decision",
    "Example",
    "Fitted",
    "Gemma3",
    "Gemma4",
    "Labelled",
    "MaskPolicy",
    "Overflow",
    "Part",
    "Revision",
    "Role",
    "Rows",
    "Segment",
    "Thinking",
    "Train",
    "Truncation",
    "TruncationReport",
    "attention_mask",
    "build",
    "check_tokenizer",
    "encode",
    "loss_scopes",
    "masked_cross_entropy",
    "pack",
    "pad",
    "padding_free",
    "prepare",
    "summed_cross_entropy",
    "token_offsets",
    "truncate",
    "tunix_inputs",
]
