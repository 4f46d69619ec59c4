"""Gemma architectures: ``GemmaSpec``, from HF configs or presets, to Tunix configs."""

from gemport.specs.spec import GLOBAL, SLIDING, GemmaSpec

__all__ = ["GLOBAL", "SLIDING", "GemmaSpec"]
