"""Sharding checks and repairs for Tunix Gemma models with Qwix LoRA on a ``("fsdp", "tp")`` mesh.

- ``audit``: one row per parameter (path, shape, dtype, spec, bytes per device, findings), printable as a table.
- ``fix_lora``: re-derive every LoRA factor's annotation from its base weight and its axes; report each change.
- ``optimizer_shardings``: Optax state shardings from the param shardings, to place the state before jit.
"""

from gemport.sharding.audit import Audit, AuditRow, audit
from gemport.sharding.lora import LoraChange, fix_lora
from gemport.sharding.optimizer import optimizer_shardings

__all__ = [
    "Audit",
    "AuditRow",
    "LoraChange",
    "audit",
    "fix_lora",
    "optimizer_shardings",
]
