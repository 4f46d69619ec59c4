"""On Gemma 3 conversations the mask equals TRL's assistant_only_loss labels, token for token."""

import pytest

import gemport.masks as masks
from test_masks_tokenizers import GEMMA3_CONTROL, bpe_tokenizer

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
    tokenizer, rows = trl_labels
    examples, report = masks.build(
        CONVERSATIONS, tokenizer, masks.Gemma3(), masks.MaskPolicy("assistant"), masks.Truncation(4096)
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
