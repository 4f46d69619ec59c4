"""Checkpoint I/O: HF safetensors <-> Tunix parameter states, streamed and atomic."""

from gemport.checkpoint.adapters import find_lora_spec, lora_params, read_orbax, save_lora_spec
from gemport.checkpoint.hf_dir import HFCheckpoint
from gemport.checkpoint.load import load_hf, load_tunix_model
from gemport.checkpoint.merge import export_merged
from gemport.checkpoint.peft_io import export_peft, import_peft
from gemport.checkpoint.save import save_hf

__all__ = [
    "HFCheckpoint",
    "export_merged",
    "export_peft",
    "find_lora_spec",
    "import_peft",
    "load_hf",
    "load_tunix_model",
    "lora_params",
    "read_orbax",
    "save_hf",
    "save_lora_spec",
]
