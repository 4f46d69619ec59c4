"""``SFTConfig.chat_template_path`` as TRL applies it, and the proof that gemport's rendering follows it.

TRL takes a ``.jinja`` / ``.j2`` file (its text becomes the tokenizer's chat template) or a tokenizer folder
(``trl.clone_chat_template``: the folder's template, its added tokens, its EOS token, and the embeddings resized to
the vocabulary rounded up to 64). gemport renders with its own Gemma renderer (``data.template.chat_format`` of
the template), so a custom template is honoured only where the two give the same training: ``check_records``
renders every conversation of the training data through the template and refuses the recipe, naming
``chat_template_path``, at the first that renders other text or (``assistant_only_loss``) trains other
characters than the template's ``{% generation %}`` spans, which are TRL's assistant masks.
"""

from __future__ import annotations

import copy
import math
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from gemport.errors import MaskError, RecipeError
from gemport.data import formats
from gemport.data.template import template_text

_FIELD = "chat_template_path"
_EMBEDDING_MULTIPLE = 64  # clone_chat_template's resize_to_multiple_of


def with_chat_template(tokenizer: Any, path: str | os.PathLike, vocab_rows: int) -> Any:
    """A copy of ``tokenizer`` with the chat template of ``path``, as TRL's ``SFTTrainer`` sets it.

    path: a ``.jinja`` / ``.j2`` file, or a tokenizer folder (``clone_chat_template``: template and EOS token).
    vocab_rows: the base's embedding rows; a folder whose cloning would add tokens or resize the embeddings
    (which changes the model) is refused. Raises ``RecipeError`` naming ``chat_template_path``.
    """
    import transformers  # optional: transformers

    path_ = Path(path)
    out = copy.deepcopy(tokenizer)
    if path_.is_file() and path_.suffix in (".jinja", ".j2"):
        out.chat_template = path_.read_text(encoding="utf-8")
        return out
    if not path_.is_dir():
        raise RecipeError(f"{_FIELD}={str(path)!r}: neither a .jinja/.j2 file nor a tokenizer folder (gemport "
                          "reads no hub name here)")
    try:
        source = transformers.AutoTokenizer.from_pretrained(path_)
    except (OSError, ValueError) as e:
        raise RecipeError(f"{_FIELD}={str(path)!r}: not a tokenizer folder ({e})") from None
    added = sorted(t.content for t in source.added_tokens_decoder.values() if t.content not in out.get_vocab())
    rows = math.ceil(len(out.get_vocab()) / _EMBEDDING_MULTIPLE) * _EMBEDDING_MULTIPLE
    if added or rows != vocab_rows:
        raise RecipeError(f"{_FIELD}={str(path)!r}: TRL's clone_chat_template would "
                          + (f"add tokens {added[:5]} and " if added else "")
                          + f"resize the embeddings from {vocab_rows} to {rows} rows, which gemport does not "
                            "reproduce; give the template as a .jinja file that uses the base's tokens")
    out.chat_template = source.get_chat_template()
    out.eos_token = source.eos_token
    index = 0
    while len(out.get_vocab()) < rows:  # clone_chat_template's filler tokens, up to the embedding rows
        out.add_tokens(transformers.AddedToken(f"<extra_id_{index}>"))
        index += 1
    return out


def check_records(records: Iterable[Any], tokenizer: Any, chat_format: Any, *, policy: Any = None,
                  text_field: str = "text", first_index: int = 0) -> int:
    """Refuse a custom chat template that gemport's ``chat_format`` does not follow on ``records``.

    Every conversational record (a ``messages`` list, or conversational prompt/completion) is rendered by
    ``tokenizer.chat_template`` and by ``chat_format``: the texts must be equal (for prompt/completion records
    the prompt with its generation prompt too, where TRL's completion mask starts), and with ``policy`` (TRL's
    ``assistant_only_loss``) the characters it trains must be the template's ``{% generation %}`` spans. Returns
    the number of records checked. Raises ``RecipeError`` naming ``chat_template_path`` and the record (by its
    index in the dataset: ``records`` begin at ``first_index``).
    """
    from transformers.utils.chat_template_utils import render_jinja_template  # optional: transformers

    template = template_text(tokenizer)
    if policy is not None and not re.search(r"\{%-?\s*generation\s*-?%\}", template):
        raise RecipeError(f"{_FIELD}: the template has no {{% generation %}} markers, which TRL's "
                          "assistant_only_loss needs (TRL raises); add them around the assistant's trained text")
    checked = 0
    for index, record in enumerate(records, first_index):
        if not isinstance(record, Mapping) or not formats.conversational(record, formats.detect(record, text_field)):
            continue
        messages, tools = formats.conversation(record)
        fmt = formats.for_record(chat_format, record)
        try:
            segments = fmt.render(messages, tools)
        except MaskError as e:
            raise RecipeError(f"{_FIELD}: record {index}: gemport cannot render it ({e})") from None
        ours = "".join(s.text for s in segments)
        try:
            # apply_chat_template's call: the special tokens (bos_token...) are template variables
            texts, spans = render_jinja_template([messages], tools=tools, chat_template=template,
                                                 return_assistant_tokens_mask=True,
                                                 enable_thinking=getattr(fmt, "enable_thinking", False),
                                                 **getattr(tokenizer, "special_tokens_map", {}))
        except Exception as e:  # a template may raise anything (jinja's TemplateError, KeyError, ...)
            raise RecipeError(f"{_FIELD}: record {index}: the template raised {type(e).__name__}: {e}") from None
        theirs = texts[0]
        if ours != theirs:
            at = next((k for k in range(min(len(ours), len(theirs))) if ours[k] != theirs[k]),
                      min(len(ours), len(theirs)))
            raise RecipeError(f"{_FIELD}: record {index} renders differently through the template than through "
                              f"gemport's {chat_format!r} from character {at}: template {theirs[max(0, at - 30):at + 30]!r}, "
                              f"gemport {ours[max(0, at - 30):at + 30]!r}; gemport trains only on text TRL would "
                              "train on: use a template that renders like the base's")
        if "prompt" in record and "messages" not in record:  # where TRL's completion mask starts
            prompt = formats.conversation({"messages": record["prompt"]})[0]
            head = "".join(s.text for s in fmt.render(prompt, tools, add_generation_prompt=True))
            try:
                theirs_head = render_jinja_template([prompt], tools=tools, chat_template=template,
                                                    add_generation_prompt=True,
                                                    enable_thinking=getattr(fmt, "enable_thinking", False),
                                                    **getattr(tokenizer, "special_tokens_map", {}))[0][0]
            except Exception as e:  # as above
                raise RecipeError(f"{_FIELD}: record {index}: the template raised {type(e).__name__} on the "
                                  f"prompt: {e}") from None
            if head != theirs_head:
                raise RecipeError(f"{_FIELD}: record {index}: its prompt with the generation prompt renders "
                                  f"{theirs_head[-60:]!r} through the template, {head[-60:]!r} through gemport, "
                                  "so the completion mask would start elsewhere than TRL's")
        if policy is not None:
            trained = np.zeros(len(ours), bool)
            start = 0
            for segment, keep in zip(segments, policy.select(segments)):
                trained[start:start + len(segment.text)] = keep
                start += len(segment.text)
            marked = np.zeros(len(theirs), bool)
            for begin, end in spans[0]:
                marked[begin:end] = True
            if not np.array_equal(trained, marked):
                at = int(np.argmax(trained != marked))
                raise RecipeError(f"{_FIELD}: record {index}: the template's {{% generation %}} spans (TRL's "
                                  f"assistant masks) differ from gemport's assistant_only_loss mask at character "
                                  f"{at} ({theirs[max(0, at - 30):at + 30]!r}); mark exactly the assistant turns' "
                                  "content and end-of-turn text")
        checked += 1
    return checked


__all__ = ["check_records", "with_chat_template"]
