"""A timeline of an engine run: every step's batch slots and KV-cache pages, as one picture.

    timeline = Timeline("my run")
    while engine.has_unfinished_requests():
        engine.step()
        timeline.record(engine)          # what the step ran (`LLMEngine.last_step`) and the queue it left
    timeline.write("run.html")           # or run.png (matplotlib)

What `--verbose` prints as text, drawn: one row per batch slot and one column per step, each cell
colored by the request the slot served (lighter and hatched while it prefills a prompt chunk, solid
while it decodes), a cross where a request was preempted; below, one row per KV-cache page that was
ever used, colored by the request whose block table held it that step (darker where several did: a
shared prefix page); at the bottom, the waiting queue's length. Static and continuous batching of the
same requests differ at a glance: under static batching, slots stay empty until the whole batch ends.

`grid()` turns the recorded steps into arrays; `timeline_html` and `timeline_png` draw them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from numba_vllm.engine.stats import StepStats

NO_REQUEST = -1  # in the owner arrays: an empty slot, a free page
PHASE_NONE, PHASE_PREFILL, PHASE_DECODE = 0, 1, 2  # slot_phase values


@dataclass
class TimelineGrid:
    """The recorded steps as arrays, columns in step order: what the renderers draw."""

    title: str
    steps: list[int]  # (T,) step indices
    request_ids: list[str]  # in order of first appearance; index = the owner values below, and the color
    slot_owner: np.ndarray  # (num_slots, T) int32: request index, or NO_REQUEST
    slot_phase: np.ndarray  # (num_slots, T) int8: PHASE_NONE / PHASE_PREFILL / PHASE_DECODE
    slot_tokens: np.ndarray  # (num_slots, T) int32: tokens the slot computed that step
    page_ids: list[int]  # (P,) the pages some step used, ascending: the rows of the page arrays
    page_owner: np.ndarray  # (P, T) int32: request index (the lowest slot's, if shared), or NO_REQUEST
    page_shared: np.ndarray  # (P, T) bool: in more than one block table that step
    num_waiting: np.ndarray  # (T,) int32: queue length during the step
    waiting_ids: list[tuple[str, ...]]  # (T,) the queue, head first
    preemptions: list[tuple[int, int, int]]  # (column, slot it held, request index) of each preemption
    num_pages: int  # usable pages of the pool (rows not shown were never used)

    @property
    def num_slots(self) -> int:
        return self.slot_owner.shape[0]

    @property
    def num_steps(self) -> int:
        return len(self.steps)


class Timeline:
    """Records an engine's steps (call `record` after each `step`) and draws them (`write`)."""

    def __init__(self, title: str = "numba-vllm"):
        self.title = title
        self._steps: list[tuple[StepStats, tuple[str, ...]]] = []  # (what ran, the queue it left)
        self._num_slots = 0
        self._num_pages = 0

    def __len__(self) -> int:
        return len(self._steps)

    def record(self, engine) -> None:
        """Note the step `engine.step()` just ran (no-op before the first, or if already noted)."""
        step = engine.last_step()
        if step is None or (self._steps and self._steps[-1][0].step == step.step):
            return
        stats = engine.stats(requests=True)
        self._num_slots = stats.num_running + stats.num_free_slots
        self._num_pages = stats.num_pages
        self._steps.append((step, tuple(r.request_id for r in stats.waiting)))

    def grid(self) -> TimelineGrid:
        return build_grid(self.title, [s for s, _ in self._steps], [w for _, w in self._steps], self._num_slots,
                          self._num_pages)  # fmt: skip

    def write(self, path: str | Path) -> Path:
        """Draw the timeline to `path`: .html (no dependency), or .png / .svg / .pdf (matplotlib)."""
        path = Path(path)
        if not self._steps:
            raise ValueError("the timeline is empty: no step was recorded")
        if path.suffix.lower() in (".html", ".htm"):
            from numba_vllm.viz.timeline_html import render_html

            path.write_text(render_html(self.grid()), encoding="utf-8")
            return path
        from numba_vllm.viz.timeline_png import render_image

        return render_image(self.grid(), path)


def check_timeline_path(path: str | Path) -> Path:
    """`path` as a Path if `Timeline.write` can draw to it (checked before a run, not after)."""
    path = Path(path)
    if path.suffix.lower() in (".html", ".htm"):
        return path
    from numba_vllm.viz.mpl import IMAGE_SUFFIXES, PlotError, check_image_path

    if path.suffix.lower() not in IMAGE_SUFFIXES:
        raise PlotError(f"{path}: a timeline is written as .html, or as {', '.join(IMAGE_SUFFIXES)} (matplotlib)")
    return check_image_path(path)


def build_grid(title: str, steps: Sequence[StepStats], waiting: Sequence[tuple[str, ...]], num_slots: int,
               num_pages: int) -> TimelineGrid:  # fmt: skip
    """The arrays of `TimelineGrid` from each step's `StepStats` and the queue it left."""
    num_steps = len(steps)
    num_slots = max([num_slots, *(s.slot + 1 for step in steps for s in step.sequences)])
    index: dict[str, int] = {}
    for step in steps:
        for s in step.sequences:
            index.setdefault(s.request_id, len(index))
        for request_id in step.preempted_request_ids:
            index.setdefault(request_id, len(index))
    page_ids = sorted({p for step in steps for s in step.sequences for p in s.page_ids})
    row_of_page = {p: i for i, p in enumerate(page_ids)}

    slot_owner = np.full((num_slots, num_steps), NO_REQUEST, np.int32)
    slot_phase = np.full((num_slots, num_steps), PHASE_NONE, np.int8)
    slot_tokens = np.zeros((num_slots, num_steps), np.int32)
    page_owner = np.full((len(page_ids), num_steps), NO_REQUEST, np.int32)
    page_holders = np.zeros((len(page_ids), num_steps), np.int32)
    last_slot: dict[str, int] = {}  # request id -> the slot it last held (where its preemption is drawn)
    preemptions = []
    for t, step in enumerate(steps):
        for request_id in step.preempted_request_ids:
            preemptions.append((t, last_slot.get(request_id, 0), index[request_id]))
        for s in step.sequences:  # by slot: a shared page keeps the lowest slot's owner
            r = index[s.request_id]
            slot_owner[s.slot, t] = r
            slot_phase[s.slot, t] = PHASE_DECODE if s.phase == "decode" else PHASE_PREFILL
            slot_tokens[s.slot, t] = s.num_new_tokens
            last_slot[s.request_id] = s.slot
            rows = [row_of_page[p] for p in s.page_ids]
            page_holders[rows, t] += 1
            free = [i for i in rows if page_owner[i, t] == NO_REQUEST]
            page_owner[free, t] = r
    return TimelineGrid(
        title=title,
        steps=[s.step for s in steps],
        request_ids=list(index),
        slot_owner=slot_owner,
        slot_phase=slot_phase,
        slot_tokens=slot_tokens,
        page_ids=page_ids,
        page_owner=page_owner,
        page_shared=page_holders > 1,
        num_waiting=np.array([s.num_waiting for s in steps], np.int32),
        waiting_ids=list(waiting),
        preemptions=preemptions,
        num_pages=num_pages,
    )


def runs(row: np.ndarray, *more: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) column ranges over which `row` (and every array in `more`) keeps one value,
    skipping NO_REQUEST: the rectangles a renderer draws for one row."""
    keys = np.stack([row, *more]) if more else row[None]
    out = []
    start = 0
    n = row.shape[0]
    for t in range(1, n + 1):
        if t == n or (keys[:, t] != keys[:, start]).any():
            if row[start] != NO_REQUEST:
                out.append((start, t))
            start = t
    return out
