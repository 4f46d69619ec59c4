"""Prove the port before the TPU hours: the GPU recipe and the port, step by step, on CPU.

``trajectory`` runs N steps of the recipe as the GPU side runs it (TRL's ``SFTTrainer`` + PEFT on torch)
and of the port (Tunix + ``gemport.step``) from the same step-0 adapter, on the user's own ``SFTConfig`` /
``LoraConfig`` and a sample of their data, and compares the learning rate, loss and grad_norm of every
step, each against a floor measured in the same run (the GPU recipe trained again, computing the same thing
with other roundings). Both sides run in float32 on CPU, where a disagreement is a difference in what is
computed, not in precision; or, asked, in the recipe's bfloat16.
"""

import copy
import dataclasses
import json
import tempfile
from collections.abc import Mapping
from pathlib import Path

from gemport.check.adapters import adapter_distances, distances, gpu_deltas, port_deltas
# With FLOOR_MULTIPLE and LEAST_ADAPTER_TOLERANCE, which callers of the SFT comparison read here.
from gemport.check.verdict import (FLOOR_MULTIPLE, LEAST_ADAPTER_TOLERANCE, LEAST_FLOOR, StepRow,  # noqa: F401
                                   Tolerances, Trajectory, step_floors)
from gemport.errors import GemportError, LoraError, RecipeError, SpecError
from gemport.recipe import TRL_LORA, read

GPU_OVERRIDES = dict(logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, bf16=False, fp16=False,
                     dataloader_num_workers=0, push_to_hub=False, eval_strategy="no")
"""What a comparison (SFT's and ``check.dpo_parity``'s) fixes on the GPU side whatever the recipe says: one process on
CPU, float32, a log line per step, nothing written, no evaluation (the training steps are compared; a recipe's
``eval_strategy: steps`` would make TRL ask for an eval split)."""


FLOOR_PADDING = 8
"""Padding columns added to every row of the port's second run, which measures the floor."""



def read_recipe(path):
    """(SFTConfig fields, LoRA fields) of a ``trl sft --config`` YAML (or JSON) file, read as ``gemport sft``
    reads it (``gemport.recipe.read``): a field that is no field of TRL's dataclasses, or one gemport does not
    reproduce set to a value other than TRL's default, raises ``RecipeError``.

    SFTConfig fields: those the recipe sets; LoRA fields: ``peft.LoraConfig``'s of TRL's ``use_peft`` and
    ``lora_*`` fields (``Recipe.lora``, ModelConfig's defaults for those unset: ``lora_dropout`` 0.05; a recipe
    that sets ``lora_*`` fields is compared with LoRA, ``use_peft`` or not), or None without either. A recipe with a 4-bit base (``load_in_4bit``) raises ``LoraError``, pointing to
    ``trajectory(qlora=)``; one `QLoraSpec.from_config` cannot reproduce raises its refusal.
    """
    recipe = read(path)
    if recipe.qlora() is not None:
        raise LoraError(
            f"{path}: the recipe loads its base in 4 bits (load_in_4bit); this comparison would run it unquantized. "
            f"Pass qlora=gemport.recipe.read({str(path)!r}).qlora() to gemport.check.parity.trajectory (docs: QLoRA)"
        )
    if any(name in recipe.model for name in TRL_LORA):
        recipe = dataclasses.replace(recipe, model={**recipe.model, "use_peft": True})
    return {name: recipe.sft[name] for name in recipe.given}, recipe.lora()


def without_dropout(lora_config):
    """(the ``peft.LoraConfig`` of ``lora_config`` with ``lora_dropout=0``, the dropout it had).

    ``trajectory`` compares step by step, which random masks would defeat: torch and JAX draw different ones.
    A recipe with dropout p is compared at p = 0, the rest unchanged, and says so; gemport's dropout at p
    (PEFT's rule: rate p on each adapted projection's LoRA input, kept values scaled by 1 / (1 - p), training
    only) is matched to PEFT in distribution by gemport's tests (mask rate and scaling, expected gradient).
    """
    given = _lora_config(lora_config, dropout=True)
    config = copy.copy(given)
    config.lora_dropout = 0.0
    return config, given.lora_dropout


def dropout_note(p: float) -> str:
    """The line ``gemport parity`` prints for a recipe with LoRA dropout ``p`` > 0, compared at 0."""
    return (f"lora_dropout={p}: compared with lora_dropout=0 on both sides, the rest of the recipe unchanged "
            f"(dropout masks are random, and torch and JAX draw different ones). At lora_dropout={p} gemport drops "
            "out as PEFT does (rate p on each adapted projection's LoRA input, kept values scaled by 1/(1-p), in "
            "training only), tested against PEFT in distribution by gemport's tests, not by this run")


def _sft_config(config, overrides):
    from trl import SFTConfig

    if isinstance(config, (str, Path)):
        config = read_recipe(config)[0]
    if isinstance(config, Mapping):
        return SFTConfig(**{**config, **overrides})
    return dataclasses.replace(config, **overrides)


def _lora_config(config, dropout=False):
    import peft

    if isinstance(config, (str, Path)):
        path = Path(config)
        config = json.loads((path / "adapter_config.json" if path.is_dir() else path).read_text())
    if isinstance(config, Mapping):
        names = {f.name for f in dataclasses.fields(peft.LoraConfig)}
        config = peft.LoraConfig(**{k: v for k, v in config.items() if k in names and k != "peft_type"})
    if config.lora_dropout and not dropout:
        raise RecipeError(
            f"LoraConfig.lora_dropout={config.lora_dropout}: dropout draws random masks that differ between "
            "torch and JAX; compare with lora_dropout=0 (the rest of the recipe unchanged: without_dropout)"
        )
    return config


def miniature(config, out_dir, *, num_layers=6, hidden_size=64, head_dim=16, sliding_window=64, vocab_size=None,
              seed=0):
    """Write a random HF checkpoint with the architecture of ``config``, in miniature, to ``out_dir``.

    config: an HF checkpoint directory, a ``config.json`` path or its dict (a multimodal config's
    ``text_config`` is used). Kept: the head counts (query, KV, global KV), k_eq_v, the activation, the
    softcap, RoPE, and the sliding/global pattern of the first ``num_layers`` layers with the last one
    global, as in every Gemma (with KV-shared layers, the unshared part ends sliding, global, and the shared
    tail, ``num_layers // 3`` layers, is sliding layers then a global one). Narrowed: ``hidden_size``, MLP width (2x hidden), ``head_dim`` (global heads
    2x), ``sliding_window``, per-layer inputs and experts. ``vocab_size`` None keeps the vocabulary, so the
    real tokenizer fits (the embedding is then vocab x hidden floats). Float32 weights from
    ``torch.manual_seed(seed)``; written atomically. Returns ``out_dir`` as a Path.
    """
    import torch
    import transformers

    from gemport.checkpoint.output import atomic_dir
    from gemport._src.jsonfile import read_json
    from gemport.specs import GemmaSpec

    if not isinstance(config, Mapping):
        config = read_json(config, "config.json", SpecError, "an HF checkpoint directory or its config.json")
    fields = dict(config.get("text_config") or config)
    model_type = {"gemma4": "gemma4_text", "gemma3": "gemma3_text"}.get(fields.get("model_type"), fields.get("model_type"))
    if model_type not in ("gemma4_text", "gemma3_text"):
        raise SpecError(f"miniature: model_type {fields.get('model_type')!r} is not a Gemma 3 or Gemma 4 text model")
    if model_type == "gemma4_text":
        global_kv = GemmaSpec.from_hf(dict(fields, model_type=model_type)).global_kv_heads
    layer_types = list(fields.get("layer_types") or [])[:num_layers]
    if layer_types:
        layer_types[-1] = "full_attention"
    fields.update(model_type=model_type, num_hidden_layers=num_layers, hidden_size=hidden_size,
                  intermediate_size=2 * hidden_size, head_dim=head_dim, architectures=None,
                  sliding_window=min(fields.get("sliding_window") or sliding_window, sliding_window))
    if layer_types:
        fields["layer_types"] = layer_types
    if model_type == "gemma4_text":
        # The global layers' widths in the keys every transformers release reads (5.15+ derives per_layer_config).
        fields.pop("per_layer_config", None)
        fields.update(global_head_dim=2 * head_dim, num_global_key_value_heads=global_kv)
        if fields.get("hidden_size_per_layer_input"):
            fields["hidden_size_per_layer_input"] = 8
        if fields.get("num_kv_shared_layers"):
            # KV-shared tails (E2B, E4B): Tunix's sharing equals HF's only when the unshared layers end sliding,
            # global (gemport.specs.hf), which the first layers of the pattern need not do; so the unshared part
            # ends so, and the shared tail has a sliding and a global layer as the real one does.
            shared = max(1, min(fields["num_kv_shared_layers"], num_layers // 3))
            unshared = (layer_types or ["sliding_attention"] * num_layers)[: num_layers - shared]
            unshared[-2:] = ["sliding_attention", "full_attention"]
            fields["layer_types"] = unshared + ["sliding_attention"] * (shared - 1) + ["full_attention"]
            fields["num_kv_shared_layers"] = shared
        if fields.get("enable_moe_block"):
            fields.update(num_experts=min(fields["num_experts"], 4), top_k_experts=min(fields["top_k_experts"], 2),
                          moe_intermediate_size=hidden_size // 2)
    else:
        fields["query_pre_attn_scalar"] = head_dim
    if vocab_size is not None:
        fields["vocab_size"] = vocab_size
        if "vocab_size_per_layer_input" in fields:
            fields["vocab_size_per_layer_input"] = vocab_size
    fields = {k: v for k, v in fields.items() if v is not None}
    cfg = transformers.CONFIG_MAPPING[model_type](**{k: v for k, v in fields.items() if k != "model_type"})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with atomic_dir(Path(out_dir)) as tmp:
        model.save_pretrained(tmp)
    return Path(out_dir)


def trajectory(base_dir, data, *, sft_config, lora_config, steps=None, tokenizer=None, chat_format=None,
               port_sft_config=None, tolerances=Tolerances(), progress=True, qlora=None, loss_fn=None,
               dtype="float32"):
    """Run the GPU recipe and the port for the same steps from the same step-0 adapter; a ``Trajectory``.

    The GPU side is TRL's ``SFTTrainer`` on a ``get_peft_model`` of ``base_dir`` (PEFT's initialisation
    under ``torch.manual_seed(seed)``); that adapter is imported into Tunix (``import_peft``) and trained
    with ``data.from_sft_config`` batches, ``optim.hf_optimizer`` and ``step.train_step``. Unless
    the tolerances fix all, the GPU side trains again from that adapter on the same batches in float64 (every
    float32 step transformers asks for by name widened too; a float32 recipe's rounding, all of it). Each
    step's loss and grad_norm are held to ``FLOOR_MULTIPLE`` times how far the float32 run logged them from the
    float64 one (``StepRow.loss_floor``, ``StepRow.grad_norm_floor``, at least ``LEAST_FLOOR``). The final
    adapters are held to ``FLOOR_MULTIPLE`` times the farthest the two GPU runs end apart, or in float32 the port
    with ``FLOOR_PADDING`` more padding columns per row from the port (``Trajectory.adapter_floor``). The float64
    run costs about what the float32 one does (no gradient checkpointing: its recompute changes no value).
    Everything the port needs (model, LoRA config, optimizer, tokenizer, template, data) is checked before
    either side trains; both train in a temporary directory, removed at the end.

    Args:
      base_dir: an HF Gemma checkpoint (the real one, or a miniature of it) with its tokenizer, unless
        ``tokenizer`` is given.
      data: TRL SFT records (messages, prompt/completion or text) or a file of them (``data.formats.read``).
      sft_config: ``SFTConfig``, a dict of its fields, or a YAML/JSON path (``read_recipe``); ``max_steps`` is
        set to ``steps`` when given; float32 on CPU, one log line per step and no checkpoints are imposed on
        the GPU side.
      lora_config: ``peft.LoraConfig``, a dict, or an ``adapter_config.json`` (or its directory); dropout must
        be 0.
      steps: the optimizer steps to compare (default: the config's ``max_steps``, which must then be set).
      tokenizer: default ``AutoTokenizer.from_pretrained(base_dir)``.
      chat_format: the port's rendering (default: from the tokenizer's template). With
        ``assistant_only_loss`` and a Gemma 4 template without generation markers (TRL refuses those),
        both sides use ``data.training_template.gemma4_training_template()``.
      port_sft_config: the port's SFTConfig if it differs (default: the same), e.g. to see a broken port.
      tolerances: `Tolerances`: the bounds; loss, grad_norm and adapter left None are ``FLOOR_MULTIPLE`` times
        the floor measured in the run.
      progress: show the port's steps as a progress bar.
      qlora: a `gemport.lora.QLoraSpec` (QLoRA): the GPU side loads ``base_dir`` through bitsandbytes
        (``BitsAndBytesConfig(**qlora.to_bnb())``, then ``peft.prepare_model_for_kbit_training`` as TRL does),
        the port through `gemport.checkpoint.quantize.load_qlora_model`, both computing in float32 as the rest
        of the comparison does (``bnb_4bit_compute_dtype`` is overridden). The GPU side's adapters stay float32,
        as PEFT makes them: TRL's cast of a quantized model's adapters to bfloat16 is undone, since the port
        trains float32 factors (see docs/qlora.md for what that cast changes). bitsandbytes has no float64:
        the floor is then TRL with sdpa attention instead of eager, attention's float32 rounding only.
      loss_fn: the port's step's loss (default ``step.segment_loss``: segment attention, chunked cross-entropy,
        as ``train_step`` and ``HFPeftTrainer`` train by default); ``step.tunix_loss`` runs Tunix's own
        attention and logits.
      dtype: ``"float32"`` (the default: a disagreement is a difference in what is computed, not in precision)
        or ``"bfloat16"``, the recipe as ``bf16: true`` trains it: the GPU side loads the base in bfloat16
        (PEFT's adapters stay float32) and computes under torch's CPU bfloat16 autocast, as TRL does on a GPU;
        the port loads a bfloat16 base with float32 factors, as ``SFTRun`` does. The floor is then the GPU
        recipe's own float32 run against its bfloat16 one: the rounding of the dtype, which the port and TRL
        each add, at different points of the computation (eager vs sdpa would differ in attention's rounding
        only).

    Returns:
      A `Trajectory`: one `StepRow` per step TRL logged (both sides' learning rate, loss and grad_norm, and the
      step's floors), each HF module's final s*B@A difference (``adapters``), the adapter floor and what the
      floors compare (``floor_name``); ``ok`` and ``first_disagreement`` judge it.

    Raises:
      RecipeError: a ``dtype`` other than float32 or bfloat16, or no ``max_steps`` and no ``steps``.
      LoraError: a QLoRA recipe compared in bfloat16.
      GemportError: the GPU recipe logged no step (empty data).
    """
    import jax
    import numpy as np
    import peft
    import torch
    import transformers
    from flax import nnx
    from tqdm.auto import tqdm
    from trl import SFTTrainer
    from trl.chat_template_utils import has_generation_markers

    from gemport.data import from_sft_config

    from gemport.step import segment_loss, train_step
    from gemport._src.torch_float64 import TorchFloat64
    from gemport.checkpoint import import_peft, load_model
    from gemport.checkpoint.quantize import load_qlora_model
    from gemport.lora import LoraSpec, apply_lora
    from gemport.data import formats
    from gemport.data.training_template import gemma4_training_template
    from gemport.optim import hf_optimizer
    from gemport.specs import GemmaSpec

    if dtype not in ("float32", "bfloat16"):
        raise RecipeError(f"trajectory: dtype {dtype!r}; compare in float32 or bfloat16")
    bf16 = dtype == "bfloat16"
    if bf16 and qlora is not None:
        raise LoraError("trajectory: a QLoRA recipe is compared in float32 (its compute dtype is overridden)")
    records = list(formats.read(data)) if isinstance(data, (str, Path)) else list(data)
    lora = _lora_config(lora_config)
    with tempfile.TemporaryDirectory(prefix="gemport-parity-") as work:
        work = Path(work)
        overrides = dict(GPU_OVERRIDES, output_dir=str(work / "trl"))
        if steps is not None:
            overrides["max_steps"] = steps
        gpu_config = _sft_config(sft_config, overrides)
        port_config = gpu_config if port_sft_config is None else _sft_config(port_sft_config, overrides)
        float32_config = gpu_config
        if bf16:  # torch's CPU autocast, as accelerate sets it up for bf16 on a CPU
            gpu_config = dataclasses.replace(gpu_config, bf16=True)
        if gpu_config.max_steps is None or gpu_config.max_steps <= 0:
            raise RecipeError("trajectory: set max_steps in the SFTConfig or pass steps=")
        tokenizer = tokenizer or transformers.AutoTokenizer.from_pretrained(base_dir)
        template = getattr(tokenizer, "chat_template", None) or ""
        if gpu_config.assistant_only_loss and "<|turn>" in template and not has_generation_markers(template):
            tokenizer.chat_template = gemma4_training_template()
        # Everything the port needs of the model, LoRA config, optimizer, tokenizer, template and data is checked
        # before either side trains.
        spec = GemmaSpec.from_hf(base_dir)
        LoraSpec.from_peft(lora)
        hf = hf_optimizer(port_config, num_training_steps=port_config.max_steps)
        pipeline = from_sft_config(port_config, tokenizer, chat_format=chat_format)
        examples, _ = pipeline.examples(records, tokenizer, progress=False)

        if qlora is not None:
            qlora = dataclasses.replace(qlora, compute_dtype="float32")
        quantization = transformers.BitsAndBytesConfig(**qlora.to_bnb()) if qlora is not None else None
        import datasets

        def gpu_run(attention, config, dtype=None, **load):
            # A fresh TrainingArguments sets accelerate's process-wide state up again, mixed precision included:
            # one set up for a run in the other dtype refuses to change.
            config = dataclasses.replace(config)
            first = not (work / "adapter0").exists()
            if first:
                torch.manual_seed(gpu_config.seed)
            dtype = dtype or (torch.bfloat16 if config.bf16 else torch.float32)
            model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype,
                                                                      attn_implementation=attention,
                                                                      quantization_config=quantization, **load)
            if qlora is not None:
                model = peft.prepare_model_for_kbit_training(model, gpu_config.gradient_checkpointing)
            if first:
                model = peft.get_peft_model(model, lora)
                model.save_pretrained(work / "adapter0")
            else:
                model = peft.PeftModel.from_pretrained(model, work / "adapter0", is_trainable=True)
            # TRL 1.x casts a quantized model's adapters to bfloat16; Qwix trains them in float32 (the dtype of the
            # 4-bit base's scales), as PEFT creates them: compare the float32 recipe (docs/qlora.md).
            adapters = {n: p.data for n, p in model.named_parameters() if p.requires_grad} if qlora is not None else {}
            trainer = SFTTrainer(model=model, args=config, train_dataset=datasets.Dataset.from_list(records),
                                 processing_class=tokenizer)
            for name, p in model.named_parameters():
                if name in adapters:
                    p.data = adapters[name]
            trainer.train()
            return model, [e for e in trainer.state.log_history if "loss" in e and "grad_norm" in e]

        model, logs = gpu_run("eager", gpu_config)

        start = import_peft(work / "adapter0", base_dir=base_dir)
        lora_spec = start.lora_spec
        base = (load_model(base_dir, spec=spec, param_dtype=dtype) if qlora is None
                else load_qlora_model(base_dir, qlora, spec=spec))
        step = train_step(wrt=nnx.LoRAParam, loss_fn=loss_fn or segment_loss)
        batches = [batch for batch, _ in zip(pipeline.batches(examples), logs)]

        def port_run(pad, desc):
            port = apply_lora(base, spec, start, qlora=qlora)
            optimizer = nnx.Optimizer(port, hf.tx, wrt=nnx.LoRAParam)
            metrics = [jax.device_get(step(port, optimizer, {k: np.pad(v, ((0, 0), (0, 0), (0, pad)))
                                                             for k, v in batch.items()}))
                       for _, batch in tqdm(batches, desc=desc, disable=not progress)]
            return port, metrics

        port, metrics = port_run(0, "port")
        gpu, trained = gpu_deltas(model), port_deltas(port, spec, lora_spec)
        adapters = distances(trained, gpu)
        floors, floor, floor_name = [(None, None)] * len(logs), None, None
        if None in (tolerances.loss, tolerances.grad_norm, tolerances.adapter) and logs:
            # The recipe trained again from the same adapter on the same batches, computing the same loss and
            # gradient without the dtype's rounding: the bfloat16 recipe in float32, the float32 one in float64.
            # How far the first run lands from it is the whole of its rounding error (attention, norms with large
            # gains, the loss over large logits, Adam's amplification of it), one draw of what the port's own
            # float32 arithmetic adds. Eager vs sdpa attention in float32 (the floor before) differ only in
            # attention's roundings, a part of that error counted twice: no wider than it save for the factor
            # of about 1.4 of two independent errors, which FLOOR_MULTIPLE covers, so a max with it would cost a
            # run and move no verdict.
            if bf16:
                floor_name = "TRL float32 vs bfloat16 (autocast)"
                again, again_logs = gpu_run("eager", float32_config)
            elif qlora is not None:
                # bitsandbytes quantizes 16- and 32-bit floats only: no float64 run of a 4-bit base. Its floor is
                # the narrower eager vs sdpa (attention's float32 rounding); pass fixed loss and grad_norm bounds
                # where that is too narrow.
                floor_name = "TRL eager vs sdpa attention, float32"
                again, again_logs = gpu_run("sdpa", gpu_config)
            else:
                floor_name = "TRL float64 vs float32"
                # Nothing left in float32 (transformers' norms, RoPE, softmax and loss ask for it by name). The
                # recomputed forward of gradient checkpointing would run outside the mode (autograd's thread),
                # and recomputes the same values: it is off. Experts: torch's grouped matmul has no float64 kernel.
                with TorchFloat64():
                    again, again_logs = gpu_run("eager", dataclasses.replace(gpu_config, gradient_checkpointing=False),
                                                torch.float64, experts_implementation="eager")
            floors = [(f["loss"], f["grad_norm"]) for f in step_floors(logs, again_logs, ("loss", "grad_norm"))]
            pairs = [distances(gpu_deltas(again), gpu)]
            if not bf16 and tolerances.adapter is None:
                # And the port with FLOOR_PADDING more padding columns (no target, seen by no real token; every
                # contraction over tokens changes length).
                padded = port_run(FLOOR_PADDING, "port, padded")[0]
                pairs.append(distances(port_deltas(padded, spec, lora_spec), gpu, trained))
            floor = max(*(d for pair in pairs for d in pair.values()), LEAST_FLOOR)
        rows = [StepRow(s.step, float(log["learning_rate"]), float(hf.schedule(s.step)), float(log["loss"]),
                        float(m.loss), float(log["grad_norm"]), float(m.grad_norm), *f)
                for (s, _), log, m, f in zip(batches, logs, metrics, floors)]
    if not rows:
        raise GemportError("trajectory: the GPU recipe logged no step; is the data empty?")
    return Trajectory(tuple(rows), tolerances, adapters, floor, floor_name)



__all__ = [
    "GPU_OVERRIDES",
    "StepRow",
    "Tolerances",
    "Trajectory",
    "adapter_distances",
    "dropout_note",
    "miniature",
    "read_recipe",
    "step_floors",
    "trajectory",
    "without_dropout",
]
