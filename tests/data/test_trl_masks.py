"""On Gemma 3 conversations the mask equals TRL's assistant_only_loss labels, token for token."""

import pytest

from tiny_tokenizers import GEMMA3_CONTROL, bpe_tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure thing"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": " What is 2+2? "},
        {"role": "assistant", "content": "It is 4. "},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "Sure: 6"},
    ],
    [
        {"role": "user", "content": "user model\n\nuse"},
        {"role": "assistant", "content": "model\nSure\n\n"},
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": ""},
    ],
]


@pytest.fixture(scope="module")
def trl_labels(tmp_path_factory):
    torch = pytest.importorskip("torch")
    from datasets import Dataset
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    from trl import SFTConfig, SFTTrainer
    from trl.chat_template_utils import gemma3_chat_template

    tokenizer = bpe_tokenizer(GEMMA3_CONTROL)
    # The shipped (not the training) template: TRL itself must swap in its {% generation %} variant.
    tokenizer.chat_template = gemma3_chat_template
    tokenizer.eos_token = "<end_of_turn>"
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=1, num_key_value_heads=1, head_dim=16,
    )
    args = SFTConfig(
        output_dir=str(tmp_path_factory.mktemp("trl")), assistant_only_loss=True, report_to=[], use_cpu=True
    )
    trainer = SFTTrainer(
        model=Gemma3ForCausalLM(config), args=args, processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"messages": CONVERSATIONS}),
    )
    rows = [trainer.data_collator([row]) for row in trainer.train_dataset]
    return tokenizer, [(r["input_ids"][0].numpy(), r["labels"][0].numpy()) for r in rows]


def test_gemma3_masks_equal_trl_assistant_only_loss(trl_labels):
    from gemport.data import Gemma3, MaskPolicy, Truncation, build

    tokenizer, rows = trl_labels
    examples, report = build(
        CONVERSATIONS, tokenizer, Gemma3(), MaskPolicy("assistant"), Truncation(4096)
    )
    assert report.kept == len(CONVERSATIONS)
    for example, (input_ids, labels) in zip(examples, rows, strict=True):
        assert example.tokens.tolist() == input_ids.tolist()
        assert example.loss_mask.tolist() == (labels != -100).tolist()


def test_trl_comparison_covers_a_merge_across_the_header(trl_labels):
    tokenizer, rows = trl_labels
    pieces = tokenizer.convert_ids_to_tokens(rows[0][0].tolist())
    merged = pieces.index("\nSure")
    assert pieces[merged - 1] == "model" and rows[0][1][merged] != -100


PLAIN = [{"text": "model\nSure, plain text"}, {"text": "ends with its eos<end_of_turn>"},
         {"prompt": "Q: use 2+2?", "completion": " It is 4."}, {"prompt": "user", "completion": "model\n\nSure"}]


@pytest.mark.parametrize("completion_only_loss", [True, False])
def test_text_and_prompt_completion_without_a_chat_template_equal_trl(tmp_path, completion_only_loss):
    """A base model's tokenizer (no chat template): TRL tokenizes text and prompt/completion strings without one,
    with its BOS and EOS rules; gemport's examples are TRL's rows token for token, mask included."""
    torch = pytest.importorskip("torch")
    from datasets import Dataset
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    from trl import SFTConfig, SFTTrainer

    from gemport.data import from_sft_config

    from tokenizers import processors

    tokenizer = bpe_tokenizer(GEMMA3_CONTROL)
    tokenizer.eos_token = "<end_of_turn>"
    # Gemma's tokenizer prepends <bos> itself, which TRL relies on for text (and not twice for a prompt).
    bos = ("<bos>", tokenizer.convert_tokens_to_ids("<bos>"))
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[bos])
    assert not tokenizer.chat_template and tokenizer("a")["input_ids"][0] == bos[1]
    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                              num_attention_heads=1, num_key_value_heads=1, head_dim=16)
    args = SFTConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, completion_only_loss=completion_only_loss)
    pipeline = from_sft_config(args, tokenizer)
    assert pipeline.chat_format is None
    for records in (PLAIN[:2], PLAIN[2:]):  # TRL takes one format per dataset
        trainer = SFTTrainer(model=Gemma3ForCausalLM(config), args=args, processing_class=tokenizer,
                             train_dataset=Dataset.from_list(records))
        rows = [trainer.data_collator([row]) for row in trainer.train_dataset]
        examples, _ = pipeline.examples(records, tokenizer, progress=False)
        for example, row in zip(examples, rows, strict=True):
            assert row["input_ids"][0].tolist().count(bos[1]) == 1
            assert example.tokens.tolist() == row["input_ids"][0].tolist()
            # Nothing predicts the first token: its label (TRL's labels are shifted in the loss) never counts.
            assert example.loss_mask[1:].tolist() == (row["labels"][0][1:] != -100).tolist()
