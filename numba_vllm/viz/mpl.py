"""matplotlib, only when a picture is drawn: a figure that renders to a file, without pyplot.

matplotlib is the optional `plot` extra. Figures are built with `matplotlib.figure.Figure` directly,
never `pyplot`: no global figure state, no GUI backend chosen behind the caller's back, so drawing
works the same on a headless server, in a test and in a notebook.
"""

from __future__ import annotations

from pathlib import Path

IMAGE_SUFFIXES = (".png", ".svg", ".pdf")  # what `save` writes (matplotlib's Agg, SVG and PDF renderers)
INSTALL_HINT = "pip install 'numba-vllm[plot]'"


class PlotError(ValueError):
    """A picture cannot be drawn: matplotlib is missing, or the file name says an unknown format."""


def require_matplotlib() -> None:
    """Raise `PlotError` now, before a long run, if matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise PlotError(f"drawing a picture needs matplotlib ({e}): {INSTALL_HINT}") from None


def check_image_path(path: str | Path) -> Path:
    """`path` as a Path if its suffix is an image format `save` writes and matplotlib is there."""
    path = Path(path)
    if path.suffix.lower() not in IMAGE_SUFFIXES:
        raise PlotError(f"{path}: the file name must end in {', '.join(IMAGE_SUFFIXES)}")
    require_matplotlib()
    return path


def new_figure(width_in: float, height_in: float):
    """A blank `matplotlib.figure.Figure` of the given size in inches."""
    require_matplotlib()
    from matplotlib.figure import Figure

    return Figure(figsize=(width_in, height_in), layout="constrained")


def save(figure, path: str | Path, dpi: int = 110) -> Path:
    """Write `figure` to `path` (format from its suffix); returns the path."""
    path = check_image_path(path)
    figure.savefig(path, dpi=dpi)
    return path
