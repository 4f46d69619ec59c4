"""gemport.step's train_step against TRL's SFTTrainer + PEFT on torch: the rows each step sees, the logged loss and
grad_norm per step, and the adapter after training, on tiny random Gemma 4 (31B layout) and Gemma 3 (1B)."""

from types import SimpleNamespace

import datasets
import jax
import numpy as np
import peft
import pytest
import tiny
import torch
import transformers
from flax import nnx
from float64 import TorchFloat64, relative, trajectory_bound
from tokenizers import Tokenizer, models
from trl import SFTConfig, SFTTrainer

from gemport.data import BATCH_FIELDS, optimizer_steps, pad, padding_free, stack

from gemport.step import train_step
from gemport.checkpoint import import_peft, load_model
from gemport._src.params import flat_params
from gemport.errors import BatchError
from gemport.lora import apply_lora
from gemport.optim import hf_optimizer
from gemport.specs import GemmaSpec

# All seven projections: k_proj and v_proj land on Tunix's fused kv_einsum (k_einsum on k_eq_v layers).
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SEQ = 12
N = 11  # 6 micro-batches of 2 per epoch, the last of one row; 3 optimizer steps per epoch
STEPS = 8  # three epochs, each reseeding the sampler
# A moderate learning rate: Adam's first updates are lr * sign(g), so an element whose gradient is near zero
# moves by up to lr on fp32 noise alone, in any two implementations (torch eager vs sdpa too).
ARGS = dict(
    per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=STEPS, learning_rate=5e-3,
    weight_decay=0.1, max_grad_norm=0.5, lr_scheduler_type="cosine", warmup_steps=2, seed=7, logging_steps=1,
    bf16=False,  # SFTConfig defaults to bf16 autocast, even on CPU
)


def dataset(vocab, seed=0):
    """N distinct token sequences of 5..SEQ tokens; targets: a random span in the second half and the end."""
    rng = np.random.default_rng(seed)
    tokens, loss_mask = [], []
    for i in range(N):
        n = int(rng.integers(5, SEQ + 1))
        ids = rng.integers(1, vocab, n).astype(np.int32)
        ids[0] = i + 1  # distinct first tokens, so a row names its example
        mask = np.zeros(n, bool)
        mask[int(rng.integers(1, n // 2 + 1)):] = True
        tokens.append(ids)
        loss_mask.append(mask)
    return tokens, loss_mask


def word_tokenizer(vocab):
    words = {f"w{i}": i for i in range(vocab)}
    backend = Tokenizer(models.WordLevel(vocab=words, unk_token="w1"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="w0", unk_token="w1")


class RecordingTrainer(SFTTrainer):
    """Records the first token of every row of every micro-batch the trainer feeds the model."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        self.fed.append(inputs["input_ids"][:, 0].tolist())
        return super().compute_loss(model, inputs, *args, **kwargs)


def hf_run(base, tokens, loss_mask, out, attention="eager", float64=False, **overrides):
    """TRL + PEFT on the recipe; ``float64``: the eager run without float32 steps (tests/helpers/float64.py) from that
    run's step-0 adapter, the trajectory float32 runs approximate."""
    if not float64:
        return _hf_run(base, tokens, loss_mask, out, attention, float64, **overrides)
    # Backward runs outside the mode (autograd's thread): no recomputed forward there, the same gradients.
    with TorchFloat64():
        return _hf_run(base, tokens, loss_mask, out, attention, float64, gradient_checkpointing=False, **overrides)


def _hf_run(base, tokens, loss_mask, out, attention, float64, **overrides):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64 if float64 else torch.float32,
                                                              attn_implementation=attention)
    tag = attention + ("-float64" if float64 else "")
    if float64:
        model = peft.PeftModel.from_pretrained(model, out / f"adapter0-{attention}", is_trainable=True)
    else:
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS))
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:  # PEFT starts B at zero: give the first step a non-zero delta
                    p.copy_(0.05 * torch.randn(p.shape, generator=g))
        model.save_pretrained(out / f"adapter0-{attention}")
    rows = {"input_ids": [t.tolist() for t in tokens],
            "labels": [np.where(m, t, -100).tolist() for t, m in zip(tokens, loss_mask)]}
    args = SFTConfig(output_dir=str(out / f"trl-{tag}"), report_to="none", save_strategy="no", use_cpu=True,
                     max_length=None, **{**ARGS, **overrides})
    trainer = RecordingTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_dict(rows),
                               processing_class=word_tokenizer(model.config.vocab_size))
    trainer.fed = []
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    state = {k: v.detach().numpy().copy() for k, v in model.named_parameters() if "lora_" in k}
    return SimpleNamespace(args=args, logs=logs, fed=trainer.fed, state=state, model=model)


def port_run(base, adapter, tokens, loss_mask, args, layout="pad"):
    spec = GemmaSpec.from_hf(base)
    lora = import_peft(adapter, base_dir=base)
    model = apply_lora(load_model(base), spec, lora)
    hf = hf_optimizer(args, num_training_steps=STEPS)
    optimizer = nnx.Optimizer(model, hf.tx, wrt=nnx.LoRAParam)
    step = train_step()
    metrics, fed = [], []
    for s in optimizer_steps(args, len(tokens)):
        micro = []
        for rows in s.micro_batches:
            fed.append([int(tokens[i][0]) for i in rows])
            pick = [(tokens[i], loss_mask[i]) for i in rows]
            if layout == "pad":
                micro.append(pad(pick, SEQ))
            else:
                micro.append(padding_free(pick, pad_to_multiple_of=2 * SEQ))
        batch = stack(micro, accumulation=args.gradient_accumulation_steps,
                            rows=1 if layout == "padding_free" else args.per_device_train_batch_size)
        metrics.append(jax.device_get(step(model, optimizer, batch)))
    return SimpleNamespace(metrics=metrics, fed=fed, model=model, lora_spec=lora.lora_spec, spec=spec, schedule=hf.schedule)


@pytest.fixture(scope="module", params=["gemma4_dense", "gemma3_1b"])
def runs(request, hf_checkpoint, tmp_path_factory):
    _, base = hf_checkpoint(request.param)
    out = tmp_path_factory.mktemp(f"train-{request.param}")
    tokens, loss_mask = dataset(tiny.text_config(request.param).vocab_size)
    hf = hf_run(base, tokens, loss_mask, out)
    # The same recipe on torch again with another attention kernel, and without float32 rounding: how far two
    # correct float32 runs land from the exact trajectory is the noise floor the port is held to.
    sdpa = hf_run(base, tokens, loss_mask, out, attention="sdpa")
    exact = hf_run(base, tokens, loss_mask, out, float64=True)
    port = port_run(base, out / "adapter0-eager", tokens, loss_mask, hf.args)
    return SimpleNamespace(hf=hf, sdpa=sdpa, exact=exact, port=port, base=base, out=out, tokens=tokens,
                           loss_mask=loss_mask)


def tolerance(runs, quantity, steps=slice(None)):
    return trajectory_bound([runs.hf.logs, runs.sdpa.logs], runs.exact.logs, quantity, steps)


def assert_steps_agree(runs, metrics):
    """Every step's loss and grad_norm within 10x the float32 runs' distance from the float64 trajectory."""
    assert len(runs.exact.logs) == len(metrics) == STEPS
    bounds = {q: tolerance(runs, q) for q in ("loss", "grad_norm")}
    # Steps 0 and 1 run on the step-0 adapter (warmup starts at lr 0), before Adam can amplify any noise.
    early = tolerance(runs, "grad_norm", slice(0, 2))
    worst = dict.fromkeys(bounds, 0.0)
    for i, (exact, m) in enumerate(zip(runs.exact.logs, metrics)):
        for quantity, bound in bounds.items():
            error = relative(getattr(m, quantity), exact[quantity])
            assert error <= (early if quantity == "grad_norm" and i < 2 else bound), (i, quantity, error, bound)
            worst[quantity] = max(worst[quantity], error / bound)
    print("worst error / bound:", {q: f"{w:.2f} of {bounds[q]:.1e}" for q, w in worst.items()}, f"(steps 0-1: {early:.1e})")


def test_rows_are_fed_in_the_trainers_order(runs):
    assert runs.port.fed == runs.hf.fed


def test_logged_loss_and_grad_norm_match_every_step(runs):
    assert len(runs.hf.logs) == len(runs.port.metrics) == STEPS
    assert_steps_agree(runs, runs.port.metrics)
    for i, log in enumerate(runs.hf.logs):
        assert float(runs.port.schedule(i)) == pytest.approx(log["learning_rate"], rel=1e-6), f"step {i}"
    # Clipping was active on some steps, and the loss moved.
    assert max(log["grad_norm"] for log in runs.hf.logs) > ARGS["max_grad_norm"]
    assert runs.hf.logs[-1]["loss"] != pytest.approx(runs.hf.logs[0]["loss"], rel=1e-3)


def deltas(state):
    """{PEFT module key: B @ A} of a PEFT state dict, in float64 (PEFT's scale s cancels in ``delta_error``)."""
    return {key.removesuffix("lora_A.default.weight"): np.asarray(state[key.replace("lora_A", "lora_B")], np.float64)
            @ np.asarray(state[key], np.float64) for key in state if key.endswith("lora_A.default.weight")}


def delta_error(got, want):
    return np.abs(got - want).max() / np.abs(want).max()


def test_trained_adapters_agree(runs):
    """Each module's final B @ A within 10x the largest distance of a float32 torch run's from the float64 run's."""
    from gemport.lora import LoraLayout

    exact = deltas(runs.exact.state)
    floor = max(delta_error(d[k], exact[k]) for run in (runs.hf, runs.sdpa) for d in [deltas(run.state)] for k in exact)
    assert 0 < floor < 1e-2
    params = {k: np.asarray(v, np.float64) for k, v in flat_params(runs.port.model, nnx.LoRAParam).items()}
    compared, worst = 0, 0.0
    for target, a, b in LoraLayout(runs.port.spec, runs.port.lora_spec).match(params):
        for module, (A, B) in zip(target.hf_modules, target.to_peft(a, b)):
            (key,) = [k for k in exact if k.endswith(f".{module}.")]
            error = delta_error(B @ A, exact[key])
            assert error <= 10 * floor, (module, error, floor)
            worst, compared = max(worst, error), compared + 1
    assert compared == len(exact)
    print(f"adapters: worst {worst:.1e}, bound {10 * floor:.1e}")


def test_padding_free_rows_give_the_same_steps(runs):
    port = port_run(runs.base, runs.out / "adapter0-eager", runs.tokens, runs.loss_mask, runs.hf.args, "padding_free")
    assert_steps_agree(runs, port.metrics)


def test_stack_refuses_batches_that_do_not_fit_with_a_batch_error():
    def micro(rows, width):
        return {k: np.zeros((rows, width), np.int32) for k in BATCH_FIELDS}

    with pytest.raises(BatchError, match="no micro-batch"):
        stack([])
    with pytest.raises(BatchError, match=r"different lengths \[8, 16\]"):
        stack([micro(2, 8), micro(2, 16)])
    with pytest.raises(BatchError, match="accumulation=1, rows=2"):
        stack([micro(2, 8), micro(2, 8)], accumulation=1, rows=2)
    assert stack([micro(2, 8), micro(1, 8)])["tokens"].shape == (2, 2, 8)
