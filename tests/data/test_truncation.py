"""Truncation policies: every decision, its result and its count in the report."""

import re
from collections import Counter

import numpy as np
import pytest

from gemport.data import build, encode, Gemma3, Gemma4, MaskPolicy, truncate, Truncation, TruncationReport
from gemport.errors import MaskError
from tiny_tokenizers import GEMMA3_CONTROL, char_tokenizer, trained_spans

TOKENIZER = char_tokenizer(GEMMA3_CONTROL)
# Turn lengths with one token per character: <bos> 1; "<start_of_turn>user\n" 6 + content + 2.
SHORT = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]  # 1 + 10 + 11 = 22 tokens
TWO_TURNS = SHORT + [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "Answer"}]  # 22 + 9 + 15 = 46
TRAILING_USER = SHORT + [{"role": "user", "content": "and then some"}]  # 22 + 21 = 43
NO_ASSISTANT = [{"role": "user", "content": "Hi"}]  # 11


def example(chat, policy=MaskPolicy()):
    segments = Gemma3().render(chat)
    return encode(segments, policy.select(segments), TOKENIZER)


def test_lengths_are_what_the_tests_assume():
    assert [len(example(c).tokens) for c in (SHORT, TWO_TURNS, TRAILING_USER, NO_ASSISTANT)] == [22, 46, 43, 11]


def test_fitting_example_is_kept_as_is():
    ex = example(TWO_TURNS)
    out, decision, lost = truncate(ex, Truncation(46))
    assert (out is ex, decision, lost) == (True, "kept", 0)


@pytest.mark.parametrize("overflow", ["drop", "trim"])
def test_untrained_tail_is_cut_at_the_turn_boundary(overflow):
    ex = example(TRAILING_USER)
    out, decision, lost = truncate(ex, Truncation(30, overflow))
    assert (decision, lost) == ("trimmed_untrained", 0)
    assert out.tokens.tolist() == ex.tokens[:22].tolist() and out.loss_mask.tolist() == ex.loss_mask[:22].tolist()


def test_drop_policy_drops_an_example_whose_targets_would_be_cut():
    ex = example(TWO_TURNS)
    # All 12 targets are lost: "Yo<end_of_turn>\n" (4) and "Answer<end_of_turn>\n" (8).
    assert truncate(ex, Truncation(45, "drop")) == (None, "dropped_too_long", 12)


def test_trim_policy_keeps_the_whole_turns_that_fit():
    ex = example(TWO_TURNS)
    out, decision, lost = truncate(ex, Truncation(45, "trim"))
    assert (decision, lost) == ("trimmed", 8)
    assert out.tokens.tolist() == ex.tokens[:31].tolist()
    assert trained_spans(out, TOKENIZER) == ["Yo<end_of_turn>\n"]
    assert "".join(TOKENIZER.convert_ids_to_tokens(out.tokens.tolist())).endswith("<start_of_turn>user\nQ<end_of_turn>\n")


def test_trim_that_leaves_no_target_drops():
    assert truncate(example(TWO_TURNS), Truncation(21, "trim")) == (None, "dropped_no_target", 12)


def test_last_assistant_trimmed_away_drops():
    ex = example(TWO_TURNS, MaskPolicy("last_assistant"))
    assert truncate(ex, Truncation(45, "trim")) == (None, "dropped_no_target", 8)


def test_all_zero_mask_is_dropped_even_when_it_fits():
    assert truncate(example(NO_ASSISTANT), Truncation(64)) == (None, "dropped_no_target", 0)


def test_inputs_are_not_modified():
    ex = example(TWO_TURNS)
    before = [field.copy() for field in ex]
    truncate(ex, Truncation(45, "trim"))
    assert all(np.array_equal(a, b) for a, b in zip(ex, before))


@pytest.mark.parametrize("overflow, counts, targets_lost, which", [
    ("drop", Counter(kept=2, trimmed_untrained=1, trimmed=0, dropped_too_long=1, dropped_no_target=1), 12,
     {"dropped_too_long": [1], "trimmed_untrained": [2], "dropped_no_target": [3]}),
    ("trim", Counter(kept=2, trimmed_untrained=1, trimmed=1, dropped_too_long=0, dropped_no_target=1), 8,
     {"trimmed": [1], "trimmed_untrained": [2], "dropped_no_target": [3]}),
])
def test_build_reports_every_decision(overflow, counts, targets_lost, which):
    chats = [SHORT, TWO_TURNS, TRAILING_USER, NO_ASSISTANT, SHORT]
    examples, report = build(chats, TOKENIZER, Gemma3(), MaskPolicy(), Truncation(40, overflow))
    assert report == TruncationReport(counts, targets_lost, which)
    assert {d: getattr(report, d) for d in counts} == counts
    assert repr(report) == "TruncationReport({}, targets_lost={})".format(
        ", ".join(f"{d}={n}" for d, n in counts.items()), targets_lost)
    assert len(examples) == counts["kept"] + counts["trimmed_untrained"] + counts["trimmed"]
    assert all(len(e.tokens) <= 40 and e.loss_mask.any() for e in examples)


@pytest.mark.parametrize("kwargs", [dict(max_len=1), dict(max_len=8, overflow="cut")])
def test_bad_truncation_raises(kwargs):
    with pytest.raises(MaskError):
        Truncation(**kwargs)


@pytest.mark.parametrize("make, message", [
    (lambda: Truncation(8, "cut"), "Truncation.overflow: 'cut' is not one of ('drop', 'trim')"),
    (lambda: MaskPolicy("assistant_only"),
     "MaskPolicy.train: 'assistant_only' is not one of ('assistant', 'all', 'last_assistant', 'all_tokens')"),
    (lambda: Gemma4(thinking=True), "Gemma4.thinking: True is not one of ('off', 'on', 'empty_thought')"),
    (lambda: TruncationReport().record("cut", 0), "decision: 'cut' is not one of ('kept', 'trimmed_untrained'"),
])
def test_options_name_the_field_and_their_allowed_values(make, message):
    with pytest.raises(MaskError, match=re.escape(message)):
        make()
