"""Timelines (numba_vllm/viz/timeline*.py): the arrays built from hand-written steps, the HTML and PNG
drawn from a real run (examples/continuous_batching.py, `numba-vllm run --timeline`), one-line errors."""

import importlib.util
import re
import sys
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from numba_vllm.cli import main
from numba_vllm.engine.stats import ScheduledStats, StepStats
from numba_vllm.model.config import ModelConfig
from numba_vllm.viz.timeline import NO_REQUEST, PHASE_DECODE, PHASE_NONE, PHASE_PREFILL, build_grid, runs
from tests.helpers.tiny_llama import random_weights, tiny_config_dict, write_checkpoint

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "continuous_batching.py"
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
needs_matplotlib = pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="matplotlib (the plot extra) is not installed")


def seq(request_id, slot, phase, start, n, pages, samples=True) -> ScheduledStats:
    return ScheduledStats(request_id, slot, phase, start, n, samples, tuple(pages))


# Four steps over 2 slots: x prefills (2 chunks) then decodes; y joins at step 11 sharing x's page 4,
# is preempted at step 12; z is served in slot 1 at step 13.
STEPS = [
    StepStats(10, (seq("x", 0, "prefill", 0, 16, [4], samples=False),), (), 5, 1),
    StepStats(11, (seq("x", 0, "prefill", 16, 4, [4, 7]), seq("y", 1, "prefill", 0, 20, [4, 9])), (), 3, 0),
    StepStats(12, (seq("x", 0, "decode", 20, 1, [4, 7]),), ("y",), 4, 1),
    StepStats(13, (seq("x", 0, "decode", 21, 1, [4, 7]), seq("z", 1, "prefill", 0, 3, [2])), (), 3, 1),
]
WAITING = [("y",), (), ("y",), ("y",)]


def test_grid_from_hand_written_steps():
    g = build_grid("t", STEPS, WAITING, num_slots=2, num_pages=9)
    assert g.steps == [10, 11, 12, 13] and g.request_ids == ["x", "y", "z"]
    x, y, z, _ = 0, 1, 2, NO_REQUEST
    assert g.slot_owner.tolist() == [[x, x, x, x], [_, y, _, z]]
    p, d, n = PHASE_PREFILL, PHASE_DECODE, PHASE_NONE
    assert g.slot_phase.tolist() == [[p, p, d, d], [n, p, n, p]]
    assert g.slot_tokens.tolist() == [[16, 4, 1, 1], [0, 20, 0, 3]]
    assert g.page_ids == [2, 4, 7, 9]
    assert g.page_owner.tolist() == [[_, _, _, z], [x, x, x, x], [_, x, x, x], [_, y, _, _]]  # page 4 keeps slot 0's owner
    assert g.page_shared.tolist() == [[False] * 4, [False, True, False, False], [False] * 4, [False] * 4]
    assert g.num_waiting.tolist() == [1, 0, 1, 1] and g.waiting_ids == WAITING
    assert g.preemptions == [(2, 1, y)]  # drawn at step 12's column, in slot 1, where y last ran
    assert (g.num_slots, g.num_steps, g.num_pages) == (2, 4, 9)


def test_runs_split_on_any_change_and_skip_empty_cells():
    owner = np.array([0, 0, 0, -1, -1, 1, 1, 0])
    phase = np.array([1, 1, 2, 0, 0, 1, 1, 2])
    assert runs(owner) == [(0, 3), (5, 7), (7, 8)]
    assert runs(owner, phase) == [(0, 2), (2, 3), (5, 7), (7, 8)]


class _SvgTitles(HTMLParser):
    """The tooltips (<title> inside the SVGs) and whether every tag was closed."""

    def __init__(self):
        super().__init__()
        self.titles, self.stack, self.in_title = [], [], False

    def handle_starttag(self, tag, attrs):
        if tag == "meta":  # a void element: never closed
            return
        self.stack.append(tag)
        self.in_title = tag == "title" and "svg" in self.stack

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes <{self.stack[-1] if self.stack else None}>"
        self.stack.pop()
        self.in_title = False

    def handle_data(self, data):
        if self.in_title:
            self.titles.append(data)


def _example(args, capsys) -> str:
    spec = importlib.util.spec_from_file_location("example_continuous_batching", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--tiny", "--backend", "numpy", *args])
    return capsys.readouterr().out


def test_example_html_timeline_continuous_and_static(tmp_path, capsys):
    pictures = {}
    for mode in ("continuous", "static"):
        path = tmp_path / f"{mode}.html"
        out = _example(["--scheduling", mode, "--timeline", str(path)], capsys)
        assert f"timeline: {path}" in out
        parser = _SvgTitles()
        parser.feed(path.read_text())
        assert parser.stack == []
        num_steps = int(re.search(r"steps: (\d+)", out).group(1))
        pictures[mode] = (parser.titles, num_steps)
    titles, num_steps = pictures["continuous"]
    # The example's own plan, as the verbose lines print it: C (preempted once) ran in slot 2 and was
    # preempted; E ran in the slot A left; every request decoded.
    assert any(t.startswith("C preempted at step") for t in titles)
    assert {t.split(":")[0] for t in titles if ": decode" in t} == {"A", "B", "C", "D", "E"}
    assert f"steps 0-{num_steps - 1}" in (tmp_path / "continuous.html").read_text()
    static_titles, static_steps = pictures["static"]
    assert not any("preempted" in t for t in static_titles) and static_steps > num_steps  # slots idle until a batch ends


@needs_matplotlib
def test_example_png_timeline(tmp_path, capsys):
    from matplotlib.image import imread

    path = tmp_path / "steps.png"
    _example(["--timeline", str(path)], capsys)
    image = imread(path)
    assert image.ndim == 3 and image.shape[0] > 300 and image.shape[1] > 600
    assert (image[..., :3].std(axis=(0, 1)) > 0.05).all()  # colored cells, not a blank canvas


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    cfg = tiny_config_dict()
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), cfg, random_weights(ModelConfig.from_dict(cfg), dtype="bf16"))


def test_run_writes_a_timeline(tiny_dir, tmp_path):
    path = tmp_path / "run.html"
    args = ["run", "--model", str(tiny_dir), "--prompt-ids", "5,6,7", "--prompt-ids", "9", "--max-tokens", "3", "--ignore-eos"]
    r = CliRunner().invoke(main, [*args, "--timeline", str(path)])
    assert r.exit_code == 0, r.output
    parser = _SvgTitles()
    parser.feed(path.read_text())
    # Step 0 prefills both prompts (3 and 1 tokens) and samples; steps 1-2 decode each once more.
    assert "0: prefill, steps 0-0, 3 tokens" in parser.titles and "1: prefill, steps 0-0, 1 tokens" in parser.titles
    assert "0: decode, steps 1-2, 2 tokens" in parser.titles and "1: decode, steps 1-2, 2 tokens" in parser.titles


def test_a_timeline_file_it_cannot_write_is_a_one_line_error(tiny_dir, tmp_path):
    r = CliRunner().invoke(main, ["run", "--model", str(tiny_dir), "--prompt-ids", "5", "--timeline", str(tmp_path / "t.txt")])
    assert r.exit_code == 1 and "a timeline is written as .html" in r.output and "Traceback" not in r.output


def test_an_image_without_matplotlib_is_a_clear_error_before_the_run(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    r = CliRunner().invoke(main, ["run", "--model", str(tiny_dir), "--prompt-ids", "5", "--timeline", str(tmp_path / "t.png")])
    assert r.exit_code == 1 and "pip install 'numba-vllm[plot]'" in r.output and "Traceback" not in r.output
