"""Checkpoint I/O: HF safetensors <-> Tunix parameter states, streamed and atomic."""

from gemport.checkpoint.hf_dir import HFCheckpoint
from gemport.checkpoint.load import load_hf, load_tunix_model
from gemport.checkpoint.save import save_hf

__all__ = ["HFCheckpoint", "load_hf", "load_tunix_model", "save_hf"]
