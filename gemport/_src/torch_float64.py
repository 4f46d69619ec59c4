"""torch in float64 throughout: a reference run whose distance from a float32 run is float32's whole rounding.

transformers' Gemma modules compute RMSNorm, RoPE tables, the eager softmax and the loss in float32 whatever the
model's dtype (``x.float()``, ``dtype=torch.float32``), so a model loaded in float64 still rounds to float32 at
those steps. Inside ``TorchFloat64`` every float32 request means float64.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

# Read bytes as a dtype (safetensors' loading): float32 there is the file's format, not a precision choice.
_REINTERPRET = {torch.frombuffer, torch.Tensor.view}


def _widen(value):
    return torch.float64 if value is torch.float32 else value


class TorchFloat64(TorchFunctionMode):
    """``x.float()``, ``dtype=torch.float32``, ``.to(torch.float32)`` and the default dtype give float64 inside
    this mode; results that are float32 anyway (made from a float32 tensor) are named in ``float32_results``.

    A mode holds in the thread that entered it: autograd's backward (its own thread) runs outside, which is float64
    all the same for float64 tensors, but a forward recomputed there (gradient checkpointing) is not widened.

    Example::

        with TorchFloat64() as mode:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
            logits = model(ids).logits  # float64, with no float32 step
        assert not mode.float32_results
    """

    def __init__(self):
        super().__init__()
        self.float32_results = set()

    def __enter__(self):
        # Tensors created from Python numbers (torch.tensor(0.0), an embedding scale) follow the default dtype.
        self._default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.set_default_dtype(self._default_dtype)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.float:
            func, args = torch.Tensor.double, args[:1]
        elif func not in _REINTERPRET:
            args = tuple(_widen(a) for a in args)
            kwargs = {k: _widen(v) for k, v in kwargs.items()}
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.dtype == torch.float32:
            self.float32_results.add(getattr(func, "__name__", str(func)))
        return out
