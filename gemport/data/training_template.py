"""Chat templates for the GPU side, with ``{% generation %}`` markers where gemport.data trains.

TRL's ``assistant_only_loss=True`` needs a chat template that marks the assistant's tokens with
``{% generation %}``; TRL 1.16 ships none for Gemma 4 (its Gemma 4 templates raise "not
training-compatible"). ``gemma4_training_template()`` renders the text of TRL's newest shipped Gemma 4
template (``gemma4_v5.jinja``) and marks exactly the spans ``MaskPolicy()`` trains on ``Gemma4()``'s
rendering, so a TRL run and a gemport port train the same tokens.
"""

from importlib import resources


def gemma4_training_template() -> str:
    """The Jinja text of gemport's Gemma 4 training chat template.

    Set it as ``tokenizer.chat_template`` (or write it to a file for ``SFTConfig.chat_template_path``)
    before building TRL's ``SFTTrainer`` with ``assistant_only_loss=True``. Template variables:
    ``enable_thinking`` (``Gemma4(thinking="on")``), ``keep_reasoning`` (``Gemma4(keep_reasoning=True)``),
    ``empty_thought`` (``Gemma4(thinking="empty_thought")``), ``train_reasoning`` (``MaskPolicy(reasoning=True)``),
    ``tools`` and ``add_generation_prompt``; pass the first ones through TRL's ``chat_template_kwargs``.
    It renders text conversations; a media content part raises.
    """
    return resources.files("gemport.data").joinpath("chat_templates/gemma4_training.jinja").read_text("utf-8")
