"""From conversations to fitted, masked examples."""

from gemport.masks.tokenize import check_tokenizer, encode
from gemport.masks.truncation import TruncationReport, truncate


def prepare(messages, tokenizer, chat_format, policy, truncation):
    """Renders, masks and truncates one conversation (the tokenizer is not checked: see ``build``).

    Returns (example or None, decision, targets_lost), as ``truncate`` does.
    """
    segments = chat_format.render(messages)
    return truncate(encode(segments, policy.select(segments), tokenizer), truncation)


def build(conversations, tokenizer, chat_format, policy, truncation):
    """Renders, masks and truncates every conversation.

    conversations: iterable of message lists; chat_format: ``Gemma3()`` or ``Gemma4(...)``;
    policy: ``MaskPolicy``; truncation: ``Truncation``. Checks the tokenizer once first.
    Returns (examples, report): the kept ``Example``s in input order (each of at most
    ``truncation.max_len`` tokens, each with at least one target) and the ``TruncationReport``.
    """
    check_tokenizer(tokenizer, chat_format)
    report = TruncationReport()
    examples = []
    for messages in conversations:
        example, decision, lost = prepare(messages, tokenizer, chat_format, policy, truncation)
        report.record(decision, lost)
        if example is not None:
            examples.append(example)
    return examples, report
