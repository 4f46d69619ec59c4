"""TRL's SFT dataset formats: gemport's examples equal what TRL's own SFTTrainer tokenizes and labels.

Every case runs SFTTrainer's dataset preparation on the same records and compares input_ids and
labels token for token: conversations (assistant_only_loss and not), prompt/completion
(conversational and standard, completion_only_loss), plain text, Gemma 3 and Gemma 4 (with tools,
developer messages, content parts and content None), and the same records read from JSONL,
Parquet, a datasets.Dataset and a Grain source.
"""

import json

import numpy as np
import pytest
from tokenizers.processors import TemplateProcessing

from gemport.data import Gemma3, Gemma4, MaskPolicy, Truncation
from gemport.errors import MaskError
from gemport.data import dataset, formats, template
from tiny_tokenizers import GEMMA3_CONTROL, GEMMA4_CONTROL, bpe_tokenizer

pytest.importorskip("trl")
from trl.chat_template_utils import gemma3_chat_template, gemma4_v3_chat_template, gemma4_v5_chat_template  # noqa: E402

TOOLS = [{"type": "function", "function": {
    "name": "weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City"}}, "required": ["city"]},
}}]
CALL = [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]
GEMMA4_CHATS = [
    {"id": "a", "tools": json.dumps(TOOLS), "messages": [
        {"role": "developer", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": CALL},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}, {"role": "assistant", "content": "Sunny."},
    ]},
    {"id": "b", "tools": None, "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": None},
        {"role": "user", "content": "user model\n"}, {"role": "assistant", "content": "Sure"},
    ]},
]
PARTS = [{"messages": [
    {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
    {"role": "user", "content": [{"type": "text", "text": " Hi "}, {"type": "text", "text": "there"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "Sure "}, {"type": "text", "text": "thing"}]},
]}]
PROMPT_COMPLETION = [
    {"prompt": [{"role": "user", "content": "Hi"}], "completion": [{"role": "assistant", "content": "Sure"}]},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"}],
     "completion": [{"role": "assistant", "content": "model\nIt is 6"}]},
]
STANDARD = [{"prompt": "The sky is", "completion": " blue."}, {"prompt": "use", "completion": "r model"}]
TEXT = [{"text": "It is 4."}, {"text": "Sure\n\nuser<eos>"}]


def tokenizer(control, chat_template):
    """A BPE tokenizer that, like Gemma's, adds <bos> when it tokenizes plain text."""
    tok = bpe_tokenizer(control + ["<eos>"])
    bos = tok.convert_tokens_to_ids("<bos>")
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    tok.eos_token, tok.chat_template = "<eos>", chat_template
    return tok


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """Runs TRL's SFTTrainer dataset preparation; returns [(input_ids, trained)] per kept record."""
    pytest.importorskip("torch")
    from datasets import Dataset
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    from trl import SFTConfig, SFTTrainer

    def run(tok, records, **options):
        config = Gemma3TextConfig(
            vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=1, num_key_value_heads=1, head_dim=16,
        )
        args = SFTConfig(output_dir=str(tmp_path_factory.mktemp("sft")), report_to=[], use_cpu=True, **options)
        trainer = SFTTrainer(
            model=Gemma3ForCausalLM(config), args=args, processing_class=tok, train_dataset=Dataset.from_list(records)
        )
        return [(row["input_ids"], [label != -100 for label in row["labels"]]) for row in trainer.train_dataset]

    return run


def assert_same(examples, rows):
    assert len(examples) == len(rows)
    for example, (input_ids, trained) in zip(examples, rows, strict=True):
        assert example.tokens.tolist() == input_ids
        # TRL labels the first token too; it predicts nothing, so gemport never marks it.
        assert example.loss_mask.tolist() == [False] + trained[1:]


def ours(records, tok, chat_format, **options):
    options = {"check": "raise", **options}
    examples, report = dataset.examples(records, tok, chat_format, Truncation(1024), progress=False, **options)
    assert report.kept == len(records)
    return examples


def test_gemma3_content_parts_equal_trl_assistant_only_loss(sft):
    tok = tokenizer(GEMMA3_CONTROL, gemma3_chat_template)
    rows = sft(tok, PARTS, assistant_only_loss=True)
    assert_same(ours(PARTS, tok, Gemma3(), policy=MaskPolicy("assistant")), rows)


@pytest.mark.parametrize("records", [PROMPT_COMPLETION, STANDARD, TEXT], ids=["conversational", "standard", "text"])
def test_gemma3_prompt_completion_and_text_equal_trl(sft, records):
    tok = tokenizer(GEMMA3_CONTROL, gemma3_chat_template)
    examples = ours(records, tok, Gemma3())
    assert_same(examples, sft(tok, records))
    if records is not TEXT:  # the completion is trained, not the prompt (the second record merges across)
        assert examples[0].loss_mask.sum() < len(examples[0].tokens) - 1


def test_gemma3_conversational_prompt_completion_with_assistant_only_loss(sft):
    tok = tokenizer(GEMMA3_CONTROL, gemma3_chat_template)
    rows = sft(tok, PROMPT_COMPLETION, assistant_only_loss=True)
    assert_same(ours(PROMPT_COMPLETION, tok, Gemma3(), policy=MaskPolicy("assistant")), rows)


@pytest.mark.parametrize("records", [GEMMA4_CHATS, PARTS], ids=["tools, developer, None", "content parts"])
def test_gemma4_conversations_equal_trl(sft, records):
    tok = tokenizer(GEMMA4_CONTROL, gemma4_v5_chat_template)
    examples = ours(records, tok, template.chat_format(tok))
    assert_same(examples, sft(tok, records))
    if records is GEMMA4_CHATS:
        assert "<|tool>declaration:weather{" in "".join(tok.convert_ids_to_tokens(examples[0].tokens.tolist()))


def test_gemma4_assistant_only_loss_with_the_training_template_equals_trl(sft):
    from gemport.data.training_template import gemma4_training_template

    tok = tokenizer(GEMMA4_CONTROL, gemma4_training_template())
    examples = ours(GEMMA4_CHATS, tok, template.chat_format(tok), policy=MaskPolicy("assistant"))
    assert_same(examples, sft(tok, GEMMA4_CHATS, assistant_only_loss=True))


@pytest.mark.parametrize("chat_template", [gemma4_v5_chat_template, gemma4_v3_chat_template], ids=["v5", "v3"])
def test_gemma4_prompt_completion_with_tools_equals_trl(sft, chat_template):
    tok = tokenizer(GEMMA4_CONTROL, chat_template)
    records = [
        {"prompt": c["messages"][:2], "completion": c["messages"][2:], "tools": json.dumps(TOOLS)} for c in GEMMA4_CHATS
    ]
    chat_format = template.chat_format(tok)
    assert chat_format.revision == (5 if chat_template is gemma4_v5_chat_template else 3)
    examples = ours(records, tok, chat_format)
    assert_same(examples, sft(tok, records))
    header = tok.convert_tokens_to_ids("<|turn>")
    assert not examples[0].loss_mask[examples[0].tokens == header].any()


def test_per_record_enable_thinking_equals_trl(sft):
    tok = tokenizer(GEMMA4_CONTROL, gemma4_v5_chat_template)
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning": "add"}]
    records = [{"messages": chat, "chat_template_kwargs": {"enable_thinking": flag}} for flag in (True, False)]
    examples = ours(records, tok, Gemma4(), policy=MaskPolicy("assistant"))
    rows = sft(tok, records)
    assert [e.tokens.tolist() for e in examples] == [ids for ids, _ in rows]
    assert "<|think|>" in "".join(tok.convert_ids_to_tokens(examples[0].tokens.tolist()))
    with pytest.raises(MaskError, match="chat_template_kwargs"):
        ours([{"messages": chat, "chat_template_kwargs": {"reasoning_effort": "high"}}], tok, Gemma4())


@pytest.mark.parametrize("thinking, enable_thinking, expected", [
    ("off", True, "on"), ("on", False, "off"), ("empty_thought", True, "on"), ("empty_thought", False, "empty_thought"),
    ("off", False, "off"),
])
def test_enable_thinking_of_a_record_sets_gemma4_thinking(thinking, enable_thinking, expected):
    # Thinking off keeps the empty thought block a 26B/31B rendering asked for, as the template variables do.
    record = {"messages": [], "chat_template_kwargs": {"enable_thinking": enable_thinking}}
    assert formats.for_record(Gemma4(thinking=thinking, revision=3), record) == Gemma4(
        thinking=expected, revision=3)


def test_every_source_gives_the_same_examples(tmp_path):
    from datasets import Dataset

    grain = pytest.importorskip("grain")
    tok = tokenizer(GEMMA4_CONTROL, gemma4_v5_chat_template)
    records = GEMMA4_CHATS + [dict(GEMMA4_CHATS[1], id="long", messages=GEMMA4_CHATS[1]["messages"] * 20)]
    jsonl = tmp_path / "chats.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    Dataset.from_list(records).to_parquet(tmp_path / "chats.parquet")
    class DataSource:  # Grain's RandomAccessDataSource protocol: only __len__ and __getitem__
        def __len__(self):
            return len(records)

        def __getitem__(self, i):
            return records[i]

    sources = [records, jsonl, str(tmp_path / "chats.parquet"), Dataset.from_list(records),
               grain.MapDataset.source(records), DataSource()]
    results = [dataset.examples(s, tok, Gemma4(), Truncation(500), progress=False) for s in sources]
    for examples, report in results:
        assert report.which == {"dropped_too_long": ["long"]} and report.kept == 2
        assert [e.tokens.tolist() for e in examples] == [e.tokens.tolist() for e in results[0][0]]
        assert [e.loss_mask.tolist() for e in examples] == [e.loss_mask.tolist() for e in results[0][0]]


def test_grain_transform_reads_every_format():
    grain = pytest.importorskip("grain")
    from gemport.data.grain import MaskTransform

    tok = tokenizer(GEMMA3_CONTROL, gemma3_chat_template)
    records = PROMPT_COMPLETION + STANDARD + TEXT
    transform = MaskTransform(tok, Gemma3(), None, Truncation(1024))
    rows = list(grain.MapDataset.source(records).map_with_index(transform))
    expected, report = dataset.examples(records, tok, Gemma3(), Truncation(1024), progress=False)
    assert transform.report == report
    for row, example in zip(rows, expected, strict=True):
        assert np.array_equal(row["tokens"], example.tokens) and np.array_equal(row["loss_mask"], example.loss_mask)


def test_plain_text_is_trimmed_anywhere():
    tok = tokenizer(GEMMA3_CONTROL, gemma3_chat_template)
    [example], report = dataset.examples(TEXT[:1], tok, Gemma3(), Truncation(5, "trim"), progress=False)
    assert len(example.tokens) == 5 and report.which == {"trimmed": [0]}


@pytest.mark.parametrize("record, match", [
    ({"question": "q"}, "match no SFT format"),
    ({"prompt": "q", "chosen": "a", "rejected": "b"}, "a preference pair, which `gemport dpo` and `gemport parity"),
    ({"prompt": "p", "completion": [{"role": "assistant", "content": "c"}]}, "expected a string"),
    ({"messages": "hello"}, "expected a list of messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "image": None}]}]}, r"messages\[0\].content\[0\]: a 'image' part"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": "{not json"}, "not valid JSON"),
])
def test_bad_records_raise_mask_error(record, match):
    tok = tokenizer(GEMMA4_CONTROL, gemma4_v5_chat_template)
    with pytest.raises(MaskError, match=match):
        dataset.examples([record], tok, Gemma4(), Truncation(64), progress=False, check=None)


def test_bad_files_are_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(MaskError, match="bad.jsonl:2"):
        list(formats.read(bad))
    with pytest.raises(MaskError, match="unknown data file type"):
        list(formats.read(tmp_path / "data.csv"))
