"""A `TimelineGrid` as one self-contained HTML page: inline SVG and CSS, no script, nothing fetched.

Each row is drawn as runs of equal cells (`timeline.runs`), one rectangle per run, so a long decode
is one element, not one per step; every rectangle has a tooltip (`<title>`) with the request, the
phase and the steps. Request ids are escaped: they come from clients.
"""

from __future__ import annotations

from html import escape

from numba_vllm.viz.colors import EMPTY_RGB, css, request_rgb
from numba_vllm.viz.timeline import PHASE_DECODE, TimelineGrid, runs

LABEL_WIDTH = 64  # px left of the grid, for "slot 3" / "page 17"
SLOT_ROW = 20  # px
WAITING_ROW = 40  # px: the queue-length bars
CHAR_WIDTH = 7  # px per character of a label at 11 px: a run narrower than its label gets none

STYLE = """
body { font: 13px/1.4 system-ui, sans-serif; color: #222; margin: 16px; }
h1 { font-size: 17px; margin: 0 0 4px; } h2 { font-size: 14px; margin: 14px 0 4px; }
p.note { color: #555; margin: 2px 0 8px; max-width: 70em; }
svg text { font: 11px system-ui, sans-serif; } svg .axis { fill: #666; } svg .label { fill: #fff; pointer-events: none; }
svg rect.cell:hover { stroke: #000; stroke-width: 1; }
.legend span { display: inline-block; margin-right: 12px; } .legend i { display: inline-block; width: 12px; height: 12px;
  vertical-align: -2px; margin-right: 4px; border-radius: 2px; }
"""

DEFS = """<defs>
<pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">
<line x1="0" y1="0" x2="0" y2="6" stroke="#fff" stroke-width="2" opacity="0.55"/></pattern>
<pattern id="shared" width="4" height="4" patternUnits="userSpaceOnUse">
<circle cx="2" cy="2" r="1" fill="#000" opacity="0.55"/></pattern>
</defs>"""


def render_html(grid: TimelineGrid) -> str:
    """The whole page: title, the slots, the pages, the queue, a legend."""
    cell = max(3.0, min(18.0, 1100 / max(grid.num_steps, 1)))  # px per step
    page_row = max(3, min(12, 480 // max(len(grid.page_ids), 1)))
    width = LABEL_WIDTH + cell * grid.num_steps + 8
    steps_text = f"steps {grid.steps[0]}-{grid.steps[-1]}" if grid.steps else "no steps"
    summary = (
        f"{grid.num_slots} batch slots, {len(grid.page_ids)} of {grid.num_pages} KV-cache pages used, "
        f"{len(grid.request_ids)} requests, {steps_text}, {len(grid.preemptions)} preemptions"
    )
    parts = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>{escape(grid.title)}: timeline</title><style>{STYLE}</style></head><body>",
        f"<h1>{escape(grid.title)}</h1><p class='note'>{escape(summary)}</p>",
        _legend(grid),
        "<h2>Batch slots</h2><p class='note'>One row per slot, one column per step. Hatched: a prompt (or recompute) "
        "chunk is prefilled; solid: one token is decoded; &#x2715;: the request was preempted (its pages freed).</p>",
        _slots_svg(grid, cell, width),
        "<h2>KV-cache pages</h2><p class='note'>One row per page that any step used (16 tokens each), colored by the "
        "request whose block table held it; dotted: held by several requests at once (a shared prefix).</p>",
        _pages_svg(grid, cell, page_row, width),
        "<h2>Waiting queue</h2>",
        _waiting_svg(grid, cell, width),
        "</body></html>",
    ]
    return "\n".join(parts)


def _color(r: int) -> str:
    return css(request_rgb(r))


def _legend(grid: TimelineGrid) -> str:
    items = [f"<span><i style='background:{_color(r)}'></i>{escape(rid)}</span>" for r, rid in enumerate(grid.request_ids)]
    return f"<div class='legend'>{''.join(items)}</div>"


def _step_axis(grid: TimelineGrid, cell: float, y: float) -> list[str]:
    every = max(1, round(50 / cell))  # a tick label every ~50 px
    out = []
    for t in range(0, grid.num_steps, every):
        x = LABEL_WIDTH + t * cell
        out.append(f"<text class='axis' x='{x:.1f}' y='{y}'>{grid.steps[t]}</text>")
    return out


def _slots_svg(grid: TimelineGrid, cell: float, width: float) -> str:
    height = grid.num_slots * SLOT_ROW + 16
    out = [f"<svg width='{width:.0f}' height='{height}' role='img' aria-label='batch slots by step'>", DEFS]
    for slot in range(grid.num_slots):
        y = slot * SLOT_ROW
        out.append(f"<text class='axis' x='0' y='{y + 14}'>slot {slot}</text>")
        out.append(
            f"<rect x='{LABEL_WIDTH}' y='{y + 1}' width='{cell * grid.num_steps:.1f}' height='{SLOT_ROW - 2}' "
            f"fill='{css(EMPTY_RGB)}'/>"
        )
        owner, phase = grid.slot_owner[slot], grid.slot_phase[slot]
        for start, end in runs(owner, phase):
            r = int(owner[start])
            x, w = LABEL_WIDTH + start * cell, (end - start) * cell
            decode = phase[start] == PHASE_DECODE
            tokens = int(grid.slot_tokens[slot, start:end].sum())
            what = "decode" if decode else "prefill"
            tip = f"{grid.request_ids[r]}: {what}, steps {grid.steps[start]}-{grid.steps[end - 1]}, {tokens} tokens"
            out.append(
                f"<rect class='cell' x='{x:.1f}' y='{y + 1}' width='{w:.1f}' height='{SLOT_ROW - 2}' fill='{_color(r)}'>"
                f"<title>{escape(tip)}</title></rect>"
            )
            if not decode:
                out.append(f"<rect x='{x:.1f}' y='{y + 1}' width='{w:.1f}' height='{SLOT_ROW - 2}' fill='url(#hatch)'/>")
            label = grid.request_ids[r]
            if w >= CHAR_WIDTH * len(label) + 4:
                out.append(f"<text class='label' x='{x + 3:.1f}' y='{y + 14}'>{escape(label)}</text>")
    for t, slot, r in grid.preemptions:
        x, y = LABEL_WIDTH + (t + 0.5) * cell, slot * SLOT_ROW + 14
        tip = f"{grid.request_ids[r]} preempted at step {grid.steps[t]}"
        out.append(f"<text x='{x:.1f}' y='{y}' fill='#d00' text-anchor='middle'>&#x2715;<title>{escape(tip)}</title></text>")
    out += _step_axis(grid, cell, grid.num_slots * SLOT_ROW + 13)
    out.append("</svg>")
    return "".join(out)


def _pages_svg(grid: TimelineGrid, cell: float, row: int, width: float) -> str:
    height = len(grid.page_ids) * row + 16
    out = [f"<svg width='{width:.0f}' height='{height}' role='img' aria-label='KV-cache pages by step'>", DEFS]
    label_every = max(1, round(14 / row))  # a page label every ~14 px
    for i, page_id in enumerate(grid.page_ids):
        y = i * row
        if i % label_every == 0:
            out.append(f"<text class='axis' x='0' y='{y + min(row, 11)}'>page {page_id}</text>")
        owner, shared = grid.page_owner[i], grid.page_shared[i]
        for start, end in runs(owner, shared):
            r = int(owner[start])
            x, w = LABEL_WIDTH + start * cell, (end - start) * cell
            tip = f"page {page_id}: {grid.request_ids[r]}, steps {grid.steps[start]}-{grid.steps[end - 1]}"
            if shared[start]:
                tip += " (shared)"
            out.append(
                f"<rect class='cell' x='{x:.1f}' y='{y}' width='{w:.1f}' height='{max(row - 1, 1)}' fill='{_color(r)}'>"
                f"<title>{escape(tip)}</title></rect>"
            )
            if shared[start]:
                out.append(f"<rect x='{x:.1f}' y='{y}' width='{w:.1f}' height='{max(row - 1, 1)}' fill='url(#shared)'/>")
    out += _step_axis(grid, cell, len(grid.page_ids) * row + 13)
    out.append("</svg>")
    return "".join(out)


def _waiting_svg(grid: TimelineGrid, cell: float, width: float) -> str:
    most = max(int(grid.num_waiting.max()) if grid.num_steps else 0, 1)
    out = [f"<svg width='{width:.0f}' height='{WAITING_ROW + 16}' role='img' aria-label='waiting requests by step'>"]
    out.append(f"<text class='axis' x='0' y='12'>{most} waiting</text><text class='axis' x='0' y='{WAITING_ROW}'>0</text>")
    for t in range(grid.num_steps):
        n = int(grid.num_waiting[t])
        if n == 0:
            continue
        h = WAITING_ROW * n / most
        tip = f"step {grid.steps[t]}: {n} waiting: {' '.join(grid.waiting_ids[t])}"
        out.append(
            f"<rect class='cell' x='{LABEL_WIDTH + t * cell:.1f}' y='{WAITING_ROW - h:.1f}' width='{max(cell - 1, 1):.1f}' "
            f"height='{h:.1f}' fill='#888'><title>{escape(tip)}</title></rect>"
        )
    out += _step_axis(grid, cell, WAITING_ROW + 13)
    out.append("</svg>")
    return "".join(out)
