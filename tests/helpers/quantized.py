"""What a 4-bit base holds, read back for tests."""

import numpy as np
import qwix

from gemport._src.params import flat_params


def dequantized(model) -> dict[str, np.ndarray]:
    """``{Tunix weight path: float32 array}`` of a model's 4-bit weights, dequantized as Qwix computes them."""
    flat = flat_params(model)
    suffix = ".array.qvalue"
    return {
        key[: -len(suffix)]: np.asarray(qwix.dequantize(qwix.QArray(
            value, flat[key[: -len("qvalue")] + "scale"], qtype="nf4")), np.float32)
        for key, value in flat.items() if key.endswith(suffix)
    }
