"""PEFT's names of the seven projections of a Gemma decoder layer: LoRA's targets in the tests that adapt them all."""

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
