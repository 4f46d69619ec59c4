"""Serving engines as consumers of gemport's exports, run as users serve them.

`serve_vllm` (``vllm_offline``) runs vLLM's offline ``LLM`` in an interpreter that has vLLM (vLLM pins its own
torch and transformers, so it usually has a venv of its own: ``make vllm``) and returns its greedy
continuations and top logprobs; `gemport.verify.compare_vllm` compares them with transformers (+ PEFT) and Tunix.
"""

from gemport.engines.vllm_offline import PYTHON_ENV, Served, max_lora_rank, serve_vllm, vllm_python

__all__ = [
    "PYTHON_ENV",
    "Served",
    "max_lora_rank",
    "serve_vllm",
    "vllm_python",
]
