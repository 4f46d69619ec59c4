"""Sharding checks and repairs for Tunix Gemma models with Qwix LoRA on a ``("fsdp", "tp")`` mesh.

- ``audit``: one row per parameter (path, shape, dtype, spec, bytes per device, findings), printable as a table.
- ``fix_lora``: re-derive every LoRA factor's annotation from its base weight and einsum; report each change.
- ``optimizer_shardings``: Optax state shardings from the param shardings, to place the state before jit.
"""

from gemport.sharding.audit import Audit, AuditRow, audit
from gemport.sharding.lora import LoraChange, fix_lora, lora_layout, lora_shapes, lora_specs
from gemport.sharding.optimizer import optimizer_shardings

__all__ = [
    "Audit",
    "AuditRow",
    "LoraChange",
    "audit",
    "fix_lora",
    "lora_layout",
    "lora_shapes",
    "lora_specs",
    "optimizer_shardings",
]
