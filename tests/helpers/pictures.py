"""A picture the tests check was drawn (``gemport sft --plot``'s, ``gemport parity``'s)."""

import numpy as np


def assert_picture(png, size):
    """``png`` opens as an image of ``size`` pixels, under 100 KB, with lines and text drawn on it."""
    from PIL import Image

    assert png.stat().st_size < 100_000
    with Image.open(png) as image:
        assert image.size == size
        pixels = np.asarray(image.convert("RGB"))
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 20 and pixels.std() > 10  # drawn, not blank
