"""The two sides of a LoRA-against-PEFT comparison, for the LoRA tests: a batch, the loss on each side, a PEFT model
whose B factors look trained and its gradients; ``EXPERTS``, PEFT's target_parameters on Gemma 4's MoE."""

import jax.numpy as jnp
import numpy as np
import optax
import peft
import tiny
import torch
import transformers

# PEFT's target_parameters on the MoE experts and router
EXPERTS = ["experts.gate_up_proj", "experts.down_proj", "router.proj.weight"]


def batch(vocab, step):
    return np.random.default_rng(100 + step).integers(0, vocab, (2, tiny.SEQ), dtype=np.int32)


def jax_loss(model, tokens):
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    logits, _ = model(tokens, positions, None, jnp.tril(jnp.ones((b, t, t), bool)))
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()


def torch_loss(model, tokens):
    ids = torch.as_tensor(tokens, dtype=torch.long)
    logits = model(ids).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def peft_model(path, config):
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model = peft.get_peft_model(base, config)
    with torch.no_grad():  # B as after some training, of the base weights' magnitude; A as PEFT initialised it
        for param_name, param in model.named_parameters():
            if "lora_B" in param_name:
                param.copy_(torch.randn_like(param) * 0.02)
    return model


def peft_grads(model):
    return {n.replace(".default", ""): p.grad.numpy() for n, p in model.named_parameters() if p.requires_grad}
