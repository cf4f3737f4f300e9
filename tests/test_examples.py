"""The examples run and print what their docstrings promise (in-process, through their `main`).

`continuous_batching.py --tiny` runs on a tiny random Llama (about a second); `offline_batch.py` needs
the default model (SmolLM2) and is skipped when it is not installed.
"""

import importlib.util
import re
from pathlib import Path

import pytest

from tests.helpers.smollm2 import needs_smollm2

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str):
    """Import examples/<name>.py as a module (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def summaries(out: str) -> dict[str, tuple[str, int, str]]:
    """The closing lines: request id -> (token counts and finish reason, preemptions, generated ids)."""
    found = re.findall(r"^([A-Z]): (.*), preemptions=(\d+): (.*)$", out, re.MULTILINE)
    return {request_id: (counts, int(preemptions), ids) for request_id, counts, preemptions, ids in found}


def test_continuous_batching_tiny_shows_waiting_chunks_admission_and_preemption(capsys):
    example = load_example("continuous_batching")
    example.main(["--tiny", "--backend", "numpy"])
    out = capsys.readouterr().out

    assert "a tiny random Llama, backend numpy: 3 slots, 16 tokens per step, 8 pages of 16 tokens" in out
    for _, request_id, num_prompt, max_tokens in example.ARRIVALS:
        assert f"+ {request_id} arrives: {num_prompt}-token prompt, up to {max_tokens} new tokens" in out
        assert f"- {request_id} finished (length) with {max_tokens} new tokens" in out
    steps = out.split("\nstep ")[1:]  # one chunk per step: its plan and what followed it
    assert len(steps) == int(re.search(r"steps: (\d+), preemptions: (\d+)", out).group(1))
    assert re.search(r"slot +\d+  B +prefill +\d+ tok .*\(chunk\)", out)  # the 40-token prompt in chunks
    assert re.search(r"slot +\d+  A +decode +1 tok", out)
    assert "queue: C" in out  # C waits while the budget is taken
    assert re.search(r"free pages, \d+ waiting, preempted C", out)
    assert {request_id: n for request_id, (_, n, _) in summaries(out).items()} == {"A": 0, "B": 0, "C": 1, "D": 0, "E": 0}
    # A slot freed by a finished request is taken by a request that was waiting: E runs in A's slot.
    slot_of = {m.group(2): m.group(1) for m in re.finditer(r"slot +(\d+)  ([A-E]) ", out)}
    assert slot_of["E"] == slot_of["A"]
    assert out.index("- A finished") < out.index(f"slot   {slot_of['E']}  E ")


def test_continuous_batching_preemption_does_not_change_outputs(capsys):
    example = load_example("continuous_batching")
    example.main(["--tiny", "--backend", "numpy"])  # 8 usable pages: C is preempted
    small = capsys.readouterr().out
    example.main(["--tiny", "--backend", "numpy", "--num-pages", "20"])  # room for everyone
    large = capsys.readouterr().out
    assert "preemptions: 1" in small and "preemptions: 0" in large
    same_tokens = {request_id: (counts, ids) for request_id, (counts, _, ids) in summaries(small).items()}
    assert same_tokens == {request_id: (counts, ids) for request_id, (counts, _, ids) in summaries(large).items()}
    assert len(same_tokens) == len(example.ARRIVALS)


def test_continuous_batching_rejects_a_prompt_longer_than_the_cache(capsys):
    load_example("continuous_batching").main(["--tiny", "--backend", "numpy", "--num-pages", "3"])
    out = capsys.readouterr().out
    assert "+ B rejected: the prompt has 40 tokens" in out
    assert "B: " not in out  # the others still run to the end
    assert re.search(r"steps: \d+, preemptions: \d+", out)


@pytest.mark.slow  # loads SmolLM2 and runs five prompts on the NumPy backend: ~20 s
@needs_smollm2
def test_offline_batch_on_numpy(capsys):
    load_example("offline_batch").main(["--backend", "numpy", "--max-tokens", "4"])
    out = capsys.readouterr().out
    assert out.startswith("backend: numpy")
    assert out.count("-- generate, greedy:") == 2 and out.count("-- generate, sampled:") == 1
    assert out.count("-- chat, greedy:") == 2
    counts = re.findall(r"finish_reason=(stop|length), (\d+) prompt tokens, (\d+) generated", out)
    assert len(counts) == 5
    assert all(int(prompt) > 0 and 1 <= int(new) <= 4 for _, prompt, new in counts)
    assert "Paris" in out  # SmolLM2's greedy answer to "The capital of France is"
