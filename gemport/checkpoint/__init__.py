"""Checkpoint I/O: HF safetensors <-> Tunix parameter states, streamed and atomic.

Every function takes what it reads first and where it writes second; the HF checkpoint a state or adapter
belongs to is ``base_dir=`` (it gives the architecture, the key prefix and the side files), and ``spec=`` is
needed only where no HF folder is at hand. LoRA travels as `gemport.lora.LoraParams` (factors and spec).
"""

from gemport.checkpoint.adapters import load_lora, save_lora, save_lora_spec
from gemport.checkpoint.hf_dir import HFCheckpoint
from gemport.checkpoint.load import load_hf, load_model
from gemport.checkpoint.merge import export_merged
from gemport.checkpoint.orbax import load_orbax, save_orbax
from gemport.checkpoint.output import check_output
from gemport.checkpoint.peft_io import export_peft, import_peft, peft_for_vllm, vllm_misserved
from gemport.checkpoint.quantize import load_qlora_model
from gemport.checkpoint.save import save_hf

__all__ = [
    "HFCheckpoint",
    "check_output",
    "export_merged",
    "export_peft",
    "import_peft",
    "load_hf",
    "load_lora",
    "load_model",
    "load_orbax",
    "load_qlora_model",
    "peft_for_vllm",
    "save_hf",
    "save_lora",
    "save_lora_spec",
    "save_orbax",
    "vllm_misserved",
]
