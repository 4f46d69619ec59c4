"""Greedy continuations and top logprobs from vLLM's offline ``LLM``, run as a script by the python of a venv with
vLLM: ``python vllm_worker.py REQUEST.json RESPONSE.json``.

It imports only the standard library and vLLM, so that venv needs nothing of gemport (vLLM pins its own torch
and transformers). `gemport.check.vllm_offline` writes the request and reads the response:

- request: ``runs``, each ``{"model": HF directory, "adapters": [PEFT adapter directory or null (the model
  itself), ...]}``, served one engine per run in this one process; ``prompts`` (lists of token ids),
  ``max_tokens``, ``logprobs`` (top entries per position), ``dtype``, ``max_lora_rank``,
  ``gpu_memory_utilization`` (null: 0.1 on CPU, where it is the share of host memory vLLM reserves, else
  vLLM's default).
- response: ``{"vllm": version, "runs": [[{"token_ids": [...], "logprobs": [{token id: logprob}, ...]} per
  prompt] per adapter] per run}``, or ``{"error": "missing" | "engine", "message": ...}``.
"""

import json
import os
import sys
from pathlib import Path

MISSING, ENGINE = 3, 4

# One process: no engine-core process to start (tens of seconds each on a small CPU). vLLM's info lines and the
# warnings about a folder without a tokenizer are noise here; a user's own setting wins.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def expert_adapter(adapter: Path) -> bool:
    """Whether the PEFT adapter puts LoRA on MoE experts (PEFT's ``target_parameters``)."""
    return bool(json.loads((adapter / "adapter_config.json").read_text()).get("target_parameters"))


def serve(vllm, run: dict, request: dict) -> list[list[dict]]:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory  # optional: vllm
    from vllm.lora.request import LoRARequest  # optional: vllm
    from vllm.platforms import current_platform  # optional: vllm

    model = Path(run["model"])
    adapters = run["adapters"]
    memory = request["gpu_memory_utilization"]
    if memory is None and current_platform.is_cpu():
        memory = 0.1
    options = {} if memory is None else dict(gpu_memory_utilization=memory)
    if any(adapters):
        options.update(enable_lora=True, max_loras=1, max_lora_rank=request["max_lora_rank"])
    experts = [bool(a) and expert_adapter(Path(a)) for a in adapters]
    if any(experts):
        # PEFT's target_parameters adapters hold each layer's experts as one fused 3D tensor; vLLM's Gemma 4 takes
        # them only in its "mixed" MoE LoRA format, with each such request marked.
        options.update(enable_mixed_moe_lora_format=True)
    llm = vllm.LLM(
        model=str(model),
        dtype=request["dtype"],
        # Prompts are token ids and outputs are read as ids: a folder without a tokenizer serves as well.
        skip_tokenizer_init=not (model / "tokenizer_config.json").is_file(),
        max_model_len=max(len(p) for p in request["prompts"]) + request["max_tokens"],
        seed=0,
        # In this process (no worker process), without graph capture or compilation: a check runs a few tokens.
        distributed_executor_backend="uni",
        enforce_eager=True,
        **options,
    )
    params = vllm.SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], ignore_eos=True,
                                 logprobs=request["logprobs"], detokenize=False)
    served = []
    for i, adapter in enumerate(adapters):
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in request["prompts"]],
            params,
            lora_request=LoRARequest(f"adapter{i}", i + 1, str(adapter), is_3d_lora_weight=experts[i])
            if adapter else None,
            # vLLM 0.32 divides by its progress bar's elapsed time, which a disabled bar leaves at zero.
            use_tqdm=not os.environ.get("TQDM_DISABLE"),
        )
        served.append([
            {
                "token_ids": list(o.outputs[0].token_ids),
                "logprobs": [{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs],
            }
            for o in outputs
        ])
    del llm
    cleanup_dist_env_and_memory()
    return served


def main(request_path: str, response_path: str) -> int:
    request = json.loads(Path(request_path).read_text())

    def respond(answer: dict) -> None:
        Path(response_path).write_text(json.dumps(answer))

    try:
        import vllm  # optional: vllm
    except ImportError as e:
        respond({"error": "missing", "message": f"{sys.executable} cannot import vllm ({e})"})
        return MISSING
    try:
        runs = [serve(vllm, run, request) for run in request["runs"]]
    except Exception as e:  # noqa: BLE001 - whatever vLLM raises is its refusal of the model, reported to gemport
        respond({"error": "engine", "message": f"{type(e).__name__}: {e}"})
        return ENGINE
    respond({"vllm": vllm.__version__, "runs": runs})
    return 0


if __name__ == "__main__":  # vLLM may start processes that import the main module again
    sys.exit(main(*sys.argv[1:]))
