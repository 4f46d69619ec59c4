"""From conversations to fitted, masked examples in one call."""

from gemport.masks.tokenize import check_tokenizer, encode
from gemport.masks.truncation import TruncationReport, truncate


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
        segments = chat_format.render(messages)
        example, decision, lost = truncate(encode(segments, policy.select(segments), tokenizer), truncation)
        report.record(decision, lost)
        if example is not None:
            examples.append(example)
    return examples, report
