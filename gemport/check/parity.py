"""Prove the port before the TPU hours: the GPU recipe and the port, step by step, on CPU.

``trajectory`` runs N steps of the recipe as the GPU side runs it (TRL's ``SFTTrainer`` + PEFT on torch)
and of the port (Tunix + ``gemport.step``) from the same step-0 adapter, on the user's own ``SFTConfig`` /
``LoraConfig`` and a sample of their data, and compares the learning rate, loss and grad_norm of every
step, each against a floor measured in the same run (the GPU recipe trained again, computing the same thing
with other roundings). Both sides run in float32 on CPU, where a disagreement is a difference in what is
computed, not in precision; or, asked, in the recipe's bfloat16.
"""

import dataclasses
import functools
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from gemport._src.jsonfile import read_json
from gemport.check.adapters import adapter_distances, port_deltas
from gemport.check.frame import (FLOOR_PADDING, GPU_OVERRIDES, PortRun, Quantities, Setup, compare, dropout_note,
                                 peft_config, without_dropout)
# With FLOOR_MULTIPLE, LEAST_ADAPTER_TOLERANCE and LEAST_FLOOR, which callers of the SFT comparison read here.
from gemport.check.verdict import (FLOOR_MULTIPLE, LEAST_ADAPTER_TOLERANCE, LEAST_FLOOR, StepRow,  # noqa: F401
                                   Tolerances, Trajectory, step_floors)
from gemport.checkpoint import import_peft, load_model
from gemport.checkpoint.output import atomic_dir
from gemport.checkpoint.quantize import load_qlora_model
from gemport.data import from_sft_config
from gemport.data.training_template import gemma4_training_template
from gemport.errors import LoraError, RecipeError, SpecError
from gemport.lora import LoraParams, LoraSpec, apply_lora
from gemport.optim import HFOptimizer, hf_optimizer
from gemport.recipe import TRL_LORA, read
from gemport.specs import GemmaSpec
from gemport.step import segment_loss, train_step
from gemport.step.precision import matmul_precision, with_precision


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



def _sft_config(config, overrides):
    from trl import SFTConfig  # optional: the trl extra

    if isinstance(config, (str, Path)):
        config = read_recipe(config)[0]
    if isinstance(config, Mapping):
        return SFTConfig(**{**config, **overrides})
    return dataclasses.replace(config, **overrides)



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
    import torch  # optional: the hf extra
    import transformers  # optional: the hf extra

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


@dataclasses.dataclass(frozen=True)
class _SFTSides:
    """SFT's sides over ``frame.compare``: TRL's ``SFTTrainer`` on a ``PeftModel`` of the step-0 adapter, and the
    port's ``step.train_step`` on Tunix with ``data.from_sft_config`` batches and ``optim.hf_optimizer``.

    config: the GPU side's SFTConfig. start: the step-0 adapter as the port reads it (``import_peft``). base: the
    port's base model. optimizer: the port's. step: its ``train_step``. batches: every optimizer step's
    ``(OptimizerStep, batch)``.
    """

    setup: Setup
    config: Any
    start: LoraParams
    spec: GemmaSpec
    base: nnx.Module
    optimizer: HFOptimizer
    step: Callable
    batches: list
    progress: bool
    quantities: Quantities = Quantities()

    @classmethod
    def prepare(cls, setup: Setup, *, sft_config, lora_config, chat_format, port_sft_config, progress,
                loss_fn) -> "_SFTSides":
        """Check everything the port needs of the model, LoRA config, optimizer, tokenizer, template and data,
        write the step-0 adapter and load the port's base (``trajectory``'s arguments)."""
        from trl.chat_template_utils import has_generation_markers  # optional: the trl extra

        lora = peft_config(lora_config)
        overrides = dict(setup.overrides, output_dir=str(setup.work / "trl"))
        config = _sft_config(sft_config, overrides)
        port_config = config if port_sft_config is None else _sft_config(port_sft_config, overrides)
        if config.max_steps is None or config.max_steps <= 0:
            raise RecipeError("trajectory: set max_steps in the SFTConfig or pass steps=")
        template = getattr(setup.tokenizer, "chat_template", None) or ""
        if config.assistant_only_loss and "<|turn>" in template and not has_generation_markers(template):
            setup.tokenizer.chat_template = gemma4_training_template()
        spec = GemmaSpec.from_hf(setup.base_dir)
        LoraSpec.from_peft(lora)
        optimizer = hf_optimizer(port_config, num_training_steps=port_config.max_steps)
        pipeline = from_sft_config(port_config, setup.tokenizer, chat_format=chat_format)
        examples, _ = pipeline.examples(setup.records, setup.tokenizer, progress=False)
        batches = list(pipeline.batches(examples))
        setup.write_start(lora, config.seed)
        base = (load_model(setup.base_dir, spec=spec, param_dtype=setup.dtype) if setup.qlora is None
                else load_qlora_model(setup.base_dir, setup.qlora, spec=spec))
        # The port's products at the recipe's precision (float32's on a TPU too), as SFTRun's trainer takes them:
        # the whole step traced under it, so the backward passes of custom_vjps (splash attention's) take it too.
        precision = matmul_precision(setup.dtype == "bfloat16", port_config.tf32)
        step = with_precision(train_step(wrt=nnx.LoRAParam, loss_fn=loss_fn or segment_loss), precision)
        return cls(setup, config, import_peft(setup.start, base_dir=setup.base_dir), spec, base, optimizer, step,
                   batches, progress)

    def gpu_run(self, run):
        import peft  # optional: the hf extra
        from trl import SFTTrainer  # optional: the trl extra

        model = self.setup.base(run)
        if self.setup.qlora is not None:
            model = peft.prepare_model_for_kbit_training(model, self.config.gradient_checkpointing)
        model = peft.PeftModel.from_pretrained(model, self.setup.start, is_trainable=True)
        # TRL 1.x casts a quantized model's adapters to bfloat16; Qwix trains them in float32 (the dtype of the
        # 4-bit base's scales), as PEFT creates them: compare the float32 recipe (docs/qlora.md).
        adapters = ({n: p.data for n, p in model.named_parameters() if p.requires_grad}
                    if self.setup.qlora is not None else {})
        trainer = SFTTrainer(model=model, args=run.args(self.config), train_dataset=self.setup.dataset(),
                             processing_class=self.setup.tokenizer)
        for name, p in model.named_parameters():
            if name in adapters:
                p.data = adapters[name]
        trainer.train()
        return model, trainer.state.log_history

    def sizes(self):
        tokens = max(int(np.size(batch["tokens"])) for _, batch in self.batches)
        return tokens, sum(int(np.size(v)) for v in jax.tree.leaves(self.start.params))

    def port_run(self):
        return self._port(0, "port")

    def port_again(self):
        """The port with ``FLOOR_PADDING`` more padding columns (no target, seen by no real token; every
        contraction over tokens changes length)."""
        return self._port(FLOOR_PADDING, "port, padded")

    def _port(self, pad, desc):
        port = apply_lora(self.base, self.spec, self.start, qlora=self.setup.qlora)
        optimizer = nnx.Optimizer(port, self.optimizer.tx, wrt=nnx.LoRAParam)
        logs = []
        for s, batch in tqdm(self.batches, desc=desc, disable=not self.progress):
            m = jax.device_get(self.step(port, optimizer, {k: np.pad(v, ((0, 0), (0, 0), (0, pad)))
                                                            for k, v in batch.items()}))
            logs.append({"step": s.step, "learning_rate": float(self.optimizer.schedule(s.step)),
                         "loss": float(m.loss), "grad_norm": float(m.grad_norm)})
        return PortRun(port_deltas(port, self.spec, self.start.lora_spec), logs)

    def trajectory(self, measured, tolerances):
        return Trajectory(measured.rows, tolerances, measured.adapters, measured.adapter_floor, measured.floor_name)


def trajectory(base_dir, data, *, sft_config, lora_config, steps=None, tokenizer=None, chat_format=None,
               port_sft_config=None, tolerances=Tolerances(), progress=True, qlora=None, loss_fn=None,
               dtype="float32"):
    """Run the GPU recipe and the port for the same steps from the same step-0 adapter; a ``Trajectory``.

    The GPU side is TRL's ``SFTTrainer`` on a ``get_peft_model`` of ``base_dir`` (PEFT's initialisation
    under ``torch.manual_seed(seed)``); that adapter is imported into Tunix (``import_peft``) and trained
    with ``data.from_sft_config`` batches, ``optim.hf_optimizer`` and ``step.train_step``. Each step's loss and
    grad_norm, and the final adapters, are held to ``FLOOR_MULTIPLE`` times floors measured in the same run
    (``StepRow.loss_floor``, ``StepRow.grad_norm_floor``, ``Trajectory.adapter_floor``); see
    docs/train.md#the-floors-parity-judges-against. Everything the port needs is checked before either side
    trains; both train in a temporary directory, removed at the end.

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
      qlora: a `gemport.lora.QLoraSpec` (QLoRA): the GPU side loads ``base_dir`` through bitsandbytes, the
        port through `gemport.checkpoint.quantize.load_qlora_model`, both in float32; see
        docs/train.md#with-a-4-bit-base.
      loss_fn: the port's step's loss (default ``step.segment_loss``: segment attention, chunked cross-entropy,
        as ``train_step`` and ``HFPeftTrainer`` train by default); ``step.tunix_loss`` runs Tunix's own
        attention and logits.
      dtype: ``"float32"`` (the default: a disagreement is a difference in what is computed, not in precision)
        or ``"bfloat16"``, the recipe as ``bf16: true`` trains it, judged against the GPU recipe's own float32
        run; see docs/train.md#in-bfloat16.

    Returns:
      A `Trajectory`: one `StepRow` per step TRL logged (both sides' learning rate, loss and grad_norm, and the
      step's floors), each HF module's final s*B@A difference (``adapters``), the adapter floor and what the
      floors compare (``floor_name``); ``ok`` and ``first_disagreement`` judge it.

    Raises:
      RecipeError: a ``dtype`` other than float32 or bfloat16, or no ``max_steps`` and no ``steps``.
      LoraError: a QLoRA recipe compared in bfloat16.
      GemportError: the GPU recipe logged no step (empty data), or the two sides different steps.
    """
    return compare(base_dir, data, functools.partial(
        _SFTSides.prepare, sft_config=sft_config, lora_config=lora_config, chat_format=chat_format,
        port_sft_config=port_sft_config, progress=progress, loss_fn=loss_fn),
        who="trajectory", tokenizer=tokenizer, steps=steps, dtype=dtype, qlora=qlora, tolerances=tolerances)


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
