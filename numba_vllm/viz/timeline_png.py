"""A `TimelineGrid` as an image (PNG, SVG or PDF) with matplotlib: the picture `timeline_html` draws.

Slots and pages are drawn as images, one pixel block per (row, step), so a run of thousands of steps
costs no more than a short one: a prefill cell is the request's color washed out toward white, a
decode cell its full color, a shared page darker; preemptions are red crosses, and request ids are
written on runs wide enough to hold them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from numba_vllm.viz.colors import EMPTY_RGB, request_rgb
from numba_vllm.viz.mpl import new_figure, save
from numba_vllm.viz.timeline import PHASE_PREFILL, TimelineGrid, runs

PREFILL_WASH = 0.5  # a prefill cell: this much of the way from the request's color to white
SHARED_SHADE = 0.6  # a shared page: its owner's color times this
MAX_PAGE_ROWS_DRAWN = 2000  # pages beyond are not drawn row by row: the image would be taller than useful


def _palette(grid: TimelineGrid) -> np.ndarray:
    """(num_requests + 1, 3) float: row r is request r's color; the last row (index NO_REQUEST) empty."""
    return np.array([request_rgb(r) for r in range(len(grid.request_ids))] + [EMPTY_RGB], np.float32).reshape(-1, 3)


def _image(owner: np.ndarray, palette: np.ndarray) -> np.ndarray:
    """(rows, T) request indices -> (rows, T, 3) colors (NO_REQUEST, -1, indexes the palette's last row)."""
    return palette[owner]


def render_image(grid: TimelineGrid, path: str | Path) -> Path:
    """Draw the timeline into `path` (.png, .svg or .pdf); returns the path."""
    palette = _palette(grid)
    page_rows = min(len(grid.page_ids), MAX_PAGE_ROWS_DRAWN)
    slot_h = max(1.2, 0.28 * grid.num_slots)
    page_h = max(1.2, min(6.0, 0.09 * page_rows))
    width = max(7.0, min(16.0, 3.0 + 0.12 * grid.num_steps))
    fig = new_figure(width, slot_h + page_h + 1.3 + 0.9)
    axes = fig.subplots(3, 1, sharex=True, height_ratios=[slot_h, page_h, 1.0])
    ax_slots, ax_pages, ax_wait = axes
    extent = (-0.5, grid.num_steps - 0.5)
    fig.suptitle(grid.title, fontsize=11)

    slots = _image(grid.slot_owner, palette)
    prefill = grid.slot_phase == PHASE_PREFILL
    slots[prefill] = slots[prefill] + (1 - slots[prefill]) * PREFILL_WASH
    ax_slots.imshow(slots, aspect="auto", interpolation="nearest", extent=(*extent, grid.num_slots - 0.5, -0.5))
    ax_slots.set_yticks(range(grid.num_slots), [f"slot {s}" for s in range(grid.num_slots)], fontsize=7)
    ax_slots.set_title("batch slots (washed out: prefill chunk, solid: decode, x: preempted)", fontsize=9, loc="left")
    chars_per_step = _chars_per_step(fig, ax_slots, grid.num_steps)
    for slot in range(grid.num_slots):
        for start, end in runs(grid.slot_owner[slot]):
            label = grid.request_ids[grid.slot_owner[slot, start]]
            if (end - start) * chars_per_step >= len(label) + 1:
                ax_slots.text((start + end - 1) / 2, slot, label, ha="center", va="center", fontsize=7, color="black")
    for t, slot, _ in grid.preemptions:
        ax_slots.plot([t], [slot], marker="x", color="#d00", markersize=8, markeredgewidth=2)

    if page_rows:
        pages = _image(grid.page_owner[:page_rows], palette)
        shared = grid.page_shared[:page_rows]
        pages[shared] *= SHARED_SHADE
        ax_pages.imshow(pages, aspect="auto", interpolation="nearest", extent=(*extent, page_rows - 0.5, -0.5))
        ticks = np.linspace(0, page_rows - 1, min(page_rows, 8)).round().astype(int)
        ax_pages.set_yticks(ticks, [f"page {grid.page_ids[i]}" for i in ticks], fontsize=7)
    shown = f"{page_rows} of the {len(grid.page_ids)} used" if page_rows < len(grid.page_ids) else f"{len(grid.page_ids)} used"
    ax_pages.set_title(f"KV-cache pages ({shown}, of {grid.num_pages}; darker: shared)", fontsize=9, loc="left")

    ax_wait.bar(range(grid.num_steps), grid.num_waiting, width=1.0, color="#888")
    ax_wait.set_ylabel("waiting", fontsize=8)
    ax_wait.set_xlim(*extent)
    ax_wait.set_xlabel("step", fontsize=8)
    ticks = ax_wait.get_xticks()
    ticks = [t for t in ticks if 0 <= t < grid.num_steps and float(t).is_integer()]
    ax_wait.set_xticks(ticks, [str(grid.steps[int(t)]) for t in ticks], fontsize=7)
    ax_wait.tick_params(axis="y", labelsize=7)
    return save(fig, path)


def _chars_per_step(fig, ax, num_steps: int) -> float:
    """How many 7-point characters (about 0.6 em wide) fit in one step's column of `ax`."""
    width_in = fig.get_figwidth() * ax.get_position().width
    return width_in * 72 / (7 * 0.6) / max(num_steps, 1)
