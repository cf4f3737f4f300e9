"""One color per request, the same in every picture of one run.

Hues step by the golden angle (137.5 degrees) in order of first appearance, so requests that arrive
one after the other, and so sit side by side in a timeline, never get near colors.
"""

from __future__ import annotations

import colorsys

GOLDEN_ANGLE = 137.50776405  # degrees
EMPTY_RGB = (0.93, 0.93, 0.94)  # a free slot or page


def request_rgb(index: int) -> tuple[float, float, float]:
    """The color of the `index`-th request to appear, as (r, g, b) in 0..1."""
    hue = (index * GOLDEN_ANGLE % 360) / 360
    lightness = 0.52 if index % 2 == 0 else 0.62  # every other one lighter: neighbours differ in two ways
    return colorsys.hls_to_rgb(hue, lightness, 0.62)


def css(rgb: tuple[float, float, float]) -> str:
    """(r, g, b) in 0..1 as a CSS hex color."""
    return "#" + "".join(f"{round(c * 255):02x}" for c in rgb)
