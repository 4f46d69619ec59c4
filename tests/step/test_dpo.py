"""DPO as TRL 1.16's DPOTrainer + PEFT computes it: the same tokens and masks, loss, metrics and LoRA gradients.

The peer is TRL's own DPOTrainer, built here on a tiny Gemma 3 (conversational records, chat template) and a tiny
Gemma 4 (plain-text records) with a fresh PEFT adapter whose B factors are then given random values, so the
policy differs from the reference (the base, adapter disabled) and every reward is non-zero. Tolerances: the
distance of TRL's own float32 run from the same computation in float64 (no float32 step), per quantity, and
never below float32's rounding; gemport in float32 must be within 10x of it.
"""

import float64
import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from datasets import Dataset
from flax import nnx
from tiny_tokenizers import GEMMA3_CONTROL, bpe_tokenizer
from trl import DPOConfig, DPOTrainer
from trl.chat_template_utils import gemma3_chat_template
from trl.trainer.dpo_trainer import DataCollatorForPreference

from gemport.data import collate, Gemma3, Gemma4, Preference, preferences

from gemport.step import from_dpo_config, METRICS, PAIR_LOSSES, preference_loss, sequence_logps, without_lora
from gemport.checkpoint import import_peft, load_model
from gemport.errors import MaskError, RecipeError
from gemport.lora import PROJECTIONS, LoraLayout, apply_lora
from gemport.specs import GemmaSpec
from dpo_tolerance import EPS32, reward_operands, tolerance
from preference_records import RECORDS, assistant, user


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = bpe_tokenizer(GEMMA3_CONTROL)
    tokenizer.chat_template = gemma3_chat_template
    tokenizer.eos_token = "<end_of_turn>"
    return tokenizer


def trl_trainer(path, tokenizer, records, out, dtype=torch.float32, **config):
    """TRL's DPOTrainer with a fresh PEFT adapter on the checkpoint at ``path``, B factors then set at random."""
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    config.setdefault("per_device_train_batch_size", len(records))
    args = DPOConfig(output_dir=str(out), report_to=[], use_cpu=True, bf16=False, max_length=None, **config)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(PROJECTIONS), lora_dropout=0.0)
    trainer = DPOTrainer(model=base, args=args, processing_class=tokenizer,
                         train_dataset=Dataset.from_list(records), peft_config=lora)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g, dtype=param.dtype) * 0.05)
    trainer.model.train()
    return trainer


def prepared(trainer, tokenizer, records, **args):
    """TRL's tokenized dataset of ``records`` under ``args`` (DPOConfig fields set on the trainer's config)."""
    saved = {k: getattr(trainer.args, k) for k in args}
    for k, v in args.items():
        setattr(trainer.args, k, v)
    try:
        return list(trainer._prepare_dataset(Dataset.from_list(records), tokenizer, trainer.args, "train"))
    finally:
        for k, v in saved.items():
            setattr(trainer.args, k, v)


@pytest.fixture(scope="module")
def gemma3_trainer(hf_checkpoint, tokenizer, tmp_path_factory):
    _, path = hf_checkpoint("gemma3_vllm")
    return path, trl_trainer(path, tokenizer, RECORDS["conversational"], tmp_path_factory.mktemp("trl"))


@pytest.mark.parametrize("kind", list(RECORDS))
def test_tokens_equal_trl(gemma3_trainer, tokenizer, kind):
    """Prompt, chosen and rejected ids of every record equal TRL's prepared dataset's, and with max_length
    TRL's dropped records (prompt filling max_length under keep_start) are dropped too."""
    _, trainer = gemma3_trainer
    records = RECORDS[kind]
    want = prepared(trainer, tokenizer, records)
    got = preferences(records, tokenizer, Gemma3(), max_length=None)
    assert len(got) == len(want) == len(records)
    for g, w in zip(got, want, strict=True):
        for field in Preference._fields:
            assert g._asdict()[field].tolist() == w[field], (kind, field)
    prompts = sorted(len(w["prompt_ids"]) for w in want)
    short = prompts[len(prompts) // 2]  # drops the records whose prompt has at least this many tokens
    want = prepared(trainer, tokenizer, records, max_length=short)
    got = preferences(records, tokenizer, Gemma3(), max_length=short)
    assert 0 < len(got) == len(want) < len(records)
    assert [g.prompt_ids.tolist() for g in got] == [w["prompt_ids"] for w in want]
    assert len(preferences(records, tokenizer, Gemma3(), max_length=short,
                               truncation_mode="keep_end")) == len(records)


@pytest.mark.parametrize("truncation_mode", ["keep_start", "keep_end"])
@pytest.mark.parametrize("max_length", [None, 9])
def test_collated_batch_equals_trl(gemma3_trainer, tokenizer, max_length, truncation_mode):
    """TRL's DataCollatorForPreference and data.collate lay a micro-batch out identically: input_ids, attention
    and completion masks, chosen rows then rejected rows, truncated per row, padded on the right."""
    _, trainer = gemma3_trainer
    records = RECORDS["conversational"]
    rows = prepared(trainer, tokenizer, records)
    collator = DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id, max_length=max_length,
                                         truncation_mode=truncation_mode, pad_to_multiple_of=4)
    want = collator(rows)
    pairs = preferences(records, tokenizer, Gemma3(), max_length=None)
    got = collate(pairs, max_length=max_length, truncation_mode=truncation_mode, pad_to_multiple_of=4,
                      pad_id=tokenizer.pad_token_id)
    assert got["tokens"].tolist() == want["input_ids"].tolist()
    assert got["segment_ids"].tolist() == want["attention_mask"].tolist()
    assert got["loss_mask"].astype(int).tolist() == want["completion_mask"].tolist()


def test_bad_records_and_settings_are_refused(tokenizer):
    with pytest.raises(MaskError, match=r"records\[1\].*'rejected'"):
        preferences([RECORDS["explicit"][0], {"prompt": "a", "chosen": "b"}], tokenizer)
    with pytest.raises(RecipeError, match="truncation_mode"):
        preferences(RECORDS["explicit"], tokenizer, truncation_mode="keep_middle")
    for field, value in (("loss_type", "aot"), ("loss_type", ["sigmoid", "sft"]), ("ld_alpha", 0.5),
                         ("f_divergence_type", "js_divergence"), ("use_weighting", True),
                         ("precompute_ref_log_probs", True)):
        with pytest.raises(RecipeError, match=field if field != "loss_type" else "aot|sft"):
            from_dpo_config({field: value})
    with pytest.raises(RecipeError, match="label_smoothing"):
        from_dpo_config({"loss_type": "robust", "label_smoothing": 0.5})


def trl_loss(trainer, rows, backward=True):
    """TRL's loss of one micro-batch of prepared rows, its logged metrics and (with backward) PEFT's gradients."""
    batch = trainer.data_collator(rows)
    trainer._metrics["train"].clear()
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, batch)
    metrics = {k: trainer._metrics["train"][k][-1] for k in METRICS}
    if not backward:
        return float(loss), metrics, None
    loss.backward()
    grads = {n.replace(".default", ""): p.grad.double().numpy()
             for n, p in trainer.model.named_parameters() if p.requires_grad}
    return loss.item(), metrics, grads


@pytest.fixture(scope="module", params=[("gemma3_vllm", "conversational"), ("gemma4_mesh", "explicit")],
                ids=["gemma3-conversational", "gemma4-plain"])
def dpo_case(request, hf_checkpoint, tokenizer, tmp_path_factory):
    """TRL in float32 and float64 on the same adapter and data, and gemport's model with that adapter."""
    name, kind = request.param
    _, path = hf_checkpoint(name)
    records = RECORDS[kind]
    trainer = trl_trainer(path, tokenizer, records, tmp_path_factory.mktemp("trl32"))
    adapter = tmp_path_factory.mktemp("adapter")
    trainer.model.save_pretrained(adapter)
    with float64.TorchFloat64() as mode:
        trainer64 = trl_trainer(path, tokenizer, records, tmp_path_factory.mktemp("trl64"), dtype=torch.float64)
        lora = {k: v for k, v in trainer.model.state_dict().items() if "lora_" in k}
        trainer64.model.load_state_dict(lora, strict=False)
        mode.float32_results.clear()
    spec = GemmaSpec.from_hf(path)
    lora_params = import_peft(adapter, spec=spec)
    model = apply_lora(load_model(path), spec, lora_params)
    pairs = preferences(records, tokenizer, Gemma3(), max_length=None)
    rows = prepared(trainer, tokenizer, records)
    return trainer, trainer64, mode, model, spec, lora_params, pairs, rows


def assert_step_equals_trl(trainer, trainer64, mode, model, spec, lora_spec, pairs, rows, reference=None):
    """TRL's loss, six metrics and PEFT gradients of one micro-batch of every pair against gemport's
    (``dpo_loss`` with ``reference``); returns gemport's (batch, policy logps, reference logps)."""
    loss32, metrics32, grads32 = trl_loss(trainer, rows)
    with mode:
        loss64, metrics64, grads64 = trl_loss(trainer64, rows)
    assert not mode.float32_results, mode.float32_results
    batch = collate(pairs, max_length=None, pad_id=0)
    config = from_dpo_config(trainer.args)

    def value(m, reference):  # step.dpo_loss, keeping the log-probabilities for the other loss types
        logps, ref_logps = sequence_logps(m, batch), sequence_logps(without_lora(m, reference), batch)
        loss, metrics = preference_loss(logps, ref_logps, batch, config)
        return loss, (metrics, logps, ref_logps)

    grad_fn = nnx.jit(nnx.value_and_grad(value, argnums=nnx.DiffState(0, nnx.LoRAParam), has_aux=True))
    (loss, (metrics, logps, ref_logps)), grads = grad_fn(model, reference)
    operands = reward_operands(config.beta, metrics64)
    assert abs(float(loss) - loss64) / loss64 <= tolerance(loss32, loss64, operands), (float(loss), loss32, loss64)
    for k in METRICS:
        if k == "rewards/accuracies":
            assert float(metrics[k]) == metrics64[k] == metrics32[k]
            continue
        assert abs(metrics64[k]) > 1e-4, k  # the adapter moved the policy away from the reference
        error = abs(float(metrics[k]) - metrics64[k]) / abs(metrics64[k])
        bound = tolerance(metrics32[k], metrics64[k], operands if k.startswith("rewards/") else 0.0)
        assert error <= bound, (k, float(metrics[k]), metrics32[k], metrics64[k], bound)
    flat = {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(grads)}
    floor = max(np.linalg.norm(grads32[k] - g) / np.linalg.norm(g) for k, g in grads64.items())
    bound = 10 * max(floor, EPS32)
    compared = 0
    for adapter in LoraLayout(spec, lora_spec):
        for module, (gA, gB) in zip(adapter.hf_modules, adapter.to_peft(flat[adapter.lora_a], flat[adapter.lora_b])):
            for got, factor in ((gA, "lora_A"), (gB, "lora_B")):
                want = grads64[f"base_model.model.model.{module}.{factor}.weight"]
                assert np.linalg.norm(want) > 0
                error = np.linalg.norm(got - want) / np.linalg.norm(want)
                assert error <= bound, (module, factor, error, bound)
                compared += 1
    assert compared == len(grads64)
    return batch, logps, ref_logps


def test_loss_metrics_and_lora_gradients_equal_trl(dpo_case):
    """One micro-batch of every pair: TRL's loss, its six logged metrics and every PEFT factor's gradient, from
    the sigmoid loss with the reference as the base with the adapter disabled; then, on the same log-probabilities,
    the loss of every other ported loss type (forward) against TRL's."""
    trainer, trainer64, mode, model, spec, lora_params, pairs, rows = dpo_case
    batch, logps, reference = assert_step_equals_trl(trainer, trainer64, mode, model, spec, lora_params.lora_spec,
                                                     pairs, rows)
    for loss_type in PAIR_LOSSES:
        smoothing = {"robust": 0.1, "exo_pair": 1e-3}.get(loss_type, 0.0)
        config = from_dpo_config({"loss_type": loss_type, "label_smoothing": smoothing, "beta": 0.5})
        for t in (trainer, trainer64):
            t.loss_types, t.loss_weights, t.label_smoothing, t.beta = [loss_type], [1.0], smoothing, 0.5
        try:
            loss32 = trl_loss(trainer, rows, backward=False)[0]
            with mode:
                loss64 = trl_loss(trainer64, rows, backward=False)[0]
        finally:
            for t in (trainer, trainer64):
                t.loss_types, t.loss_weights, t.label_smoothing, t.beta = ["sigmoid"], [1.0], 0.0, 0.1
        got = float(preference_loss(logps, reference, batch, config)[0])
        # The loss is a function of beta times differences of log-probabilities of tens: at least float32's rounding
        # of those, per pair on average (as rewards and margins are judged).
        magnitude = np.abs(np.asarray(logps)).sum() + np.abs(np.asarray(reference)).sum()
        operands = 0.5 * float(magnitude) / (len(logps) / 2)
        assert abs(got - loss64) / abs(loss64) <= tolerance(loss32, loss64, operands), (loss_type, got, loss32, loss64)


def test_reference_from_an_existing_adapter_equals_trl(dpo_case, tmp_path):
    """TRL given a PeftModel with an adapter keeps a frozen copy of it as the reference (its "ref" adapter, made
    here as TRL makes it); after the policy's factors move, dpo_loss with reference= those initial factors gives
    TRL's loss, metrics and gradients."""
    trainer, trainer64, mode, model, spec, lora_params, pairs, rows = dpo_case
    initial = jax.tree.map(jnp.copy, nnx.state(model, nnx.LoRAParam))  # values, not the model's variables
    saved = [{k: v.clone() for k, v in t.model.state_dict().items() if ".default." in k} for t in (trainer, trainer64)]
    g = torch.Generator().manual_seed(2)
    try:
        for t in (trainer, trainer64):
            with mode if t is trainer64 else torch.no_grad():
                t.model.add_adapter("ref", t.model.peft_config["default"])
                with torch.no_grad():
                    for name, param in t.model.named_parameters():
                        if ".default." in name:
                            t.model.get_parameter(name.replace(".default.", ".ref.")).data.copy_(param.data)
        with torch.no_grad():
            for name, param in trainer.model.named_parameters():
                if ".default." in name and "lora_B" in name:
                    param.add_(torch.randn(param.shape, generator=g) * 0.05)
        moved = {k: v for k, v in trainer.model.state_dict().items() if ".default." in k}
        trainer64.model.load_state_dict(moved, strict=False)
        trainer.model.save_pretrained(tmp_path, selected_adapters=["default"])
        nnx.update(model, import_peft(tmp_path, spec=spec).params)
        for t in (trainer, trainer64):
            for name, param in t.model.named_parameters():
                param.requires_grad_(".default." in name and "lora_" in name)
        assert_step_equals_trl(trainer, trainer64, mode, model, spec, lora_params.lora_spec, pairs, rows, initial)
    finally:
        nnx.update(model, initial)
        for t, state in zip((trainer, trainer64), saved):
            if "ref" in t.model.peft_config:
                t.model.delete_adapter("ref")
            t.model.load_state_dict(state, strict=False)


def test_gemma4_conversational_tokens_equal_trl(tmp_path):
    """Gemma 4 turns (TRL's shipped Gemma 4 template against data.Gemma4), a system message and an implicit
    prompt, tokenized by TRL's DPOTrainer data preparation (no model needed) and by data.preferences."""
    from tiny_tokenizers import GEMMA4_CONTROL
    from trl.chat_template_utils import gemma4_v5_chat_template

    tokenizer = bpe_tokenizer(GEMMA4_CONTROL)
    tokenizer.chat_template = gemma4_v5_chat_template
    tokenizer.eos_token = "<turn|>"
    records = {
        "explicit": [
            {"prompt": [{"role": "system", "content": "Be brief."}, user("Hi")], "chosen": [assistant("Sure thing")],
             "rejected": [assistant("No.")]},
            {"prompt": [user("a"), assistant("b"), user("c")], "chosen": [assistant("d")],
             "rejected": [assistant("e, f")]},
        ],
        "implicit": RECORDS["conversational_implicit"],
    }
    args = DPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_length=None)
    for kind, rows in records.items():
        trainer = type("Prep", (), {"_tokenizer": tokenizer})()
        want = list(DPOTrainer._prepare_dataset(trainer, Dataset.from_list(rows), tokenizer, args, "train"))
        got = preferences(rows, tokenizer, Gemma4(), max_length=None)
        assert len(got) == len(want) == len(rows)
        for g, w in zip(got, want, strict=True):
            for field in Preference._fields:
                assert g._asdict()[field].tolist() == w[field], (kind, field)
