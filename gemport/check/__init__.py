"""The checks: the port against its peers, before and after the TPU hours.

- ``check.parity``: the GPU recipe (TRL's ``SFTTrainer`` + PEFT) and the port, step by step (``gemport parity``);
  ``check.dpo_parity``: the same for TRL's ``DPOTrainer``. Both run in ``check.frame`` (the two sides, the floors),
  judged by ``check.verdict`` (``Trajectory``), the final adapters measured by ``check.adapters``.
- ``check.verify``: logits of an export against transformers (``compare_logits``), and vLLM's greedy continuations
  against both (``compare_vllm``, served by ``check.vllm_offline`` in vLLM's own venv).
- ``check.plots``: loss curves and parity's per-step pictures (``gemport[plot]``).

Each module is imported on its own: they need the ``parity`` / ``hf`` extras.
"""

__all__: list[str] = []
