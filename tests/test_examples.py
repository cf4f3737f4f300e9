"""The examples run and print what their docstrings promise: every mode of every example.

`continuous_batching.py --tiny` runs on a tiny random Llama (about a second), in-process through its
`main`; with a real model, and `offline_batch.py` and `structured_output.py`, it needs the default
model (SmolLM2) and is skipped when that is not installed. `step_through_kernel.py` runs as a program (it turns the
simulator on before numba is imported), each kernel with `--no-pdb` and in pdb, fed `c` commands.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
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


@pytest.mark.slow  # SmolLM2 on the NumPy backend: two JSON answers, a choice and a date
@needs_smollm2
def test_structured_output_on_numpy(capsys):
    load_example("structured_output").main(["--backend", "numpy"])
    out = capsys.readouterr().out
    assert out.startswith("backend: numpy")
    people = [json.loads(text) for text in re.findall(r"^json \(seed \d\): (.*?)\n   parsed:", out, re.MULTILINE | re.DOTALL)]
    assert len(people) == 2 and all(set(p) == {"name", "age", "likes"} for p in people)
    assert re.search(r"^choice: (Paris|London|Madrid)$", out, re.MULTILINE)
    assert re.search(r"^regex: (19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]$", out, re.MULTILINE)


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


@pytest.mark.slow  # SmolLM2 on the NumPy backend
@needs_smollm2
def test_continuous_batching_on_the_default_model(capsys):
    load_example("continuous_batching").main(["--backend", "numpy"])
    out = capsys.readouterr().out
    assert out.startswith("SmolLM2") and re.search(r"steps: \d+, preemptions: \d+", out)
    assert set(summaries(out)) == {"A", "B", "C", "D", "E"}


def step_through(*args: str, commands: str = "") -> str:
    """Run examples/step_through_kernel.py; in pdb mode, `commands` are typed at its prompts."""
    env = {**os.environ, "PYTHONPATH": str(EXAMPLES.parent)}
    r = subprocess.run(
        [sys.executable, str(EXAMPLES / "step_through_kernel.py"), *args], input=commands, capture_output=True,
        text=True, timeout=900, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "never reached" not in r.stdout, r.stdout + r.stderr
    return r.stdout


def test_step_through_rmsnorm():
    out = step_through("--kernel", "rmsnorm", "--no-pdb", "--block", "1", "--thread", "37")
    assert "sum_sq = 3.5471838   NumPy, the same float32 additions: 3.5471838" in out
    assert out.count("round shfl_xor_sync") == 10 and out.rstrip().endswith("output matches NumPy: True")
    out = step_through("--kernel", "rmsnorm", "--block", "1", "--thread", "37", commands="p sum_sq\nc\n")
    assert "stopped in rms_norm_kernel" in out and "np.float32(3.5471838)" in out
    assert out.rstrip().endswith("output matches NumPy: True")


def test_step_through_decode_attention():
    out = step_through("--kernel", "decode_attention", "--no-pdb", "--block", "1,0", "--thread", "9")
    assert "the full score; NumPy" in out and "this thread merged out[" in out
    assert out.rstrip().endswith("output matches NumPy: True")
    out = step_through("--kernel", "decode_attention", commands="c\nc\n")
    assert out.count("stopped in decode_attention_kernel") == 2 and out.rstrip().endswith("output matches NumPy: True")


@pytest.mark.slow  # a decode step of the whole model in the simulator: a minute
def test_step_through_one_token_through_the_model():
    out = step_through("--kernel", "model", "--no-pdb", "--block", "1,0", "--thread", "3")
    sums = re.search(r"sum_sq\[0\] = ([\d.]+)   NumPy sum of the squares of those x: ([\d.]+)", out)
    assert sums and float(sums.group(1)) == pytest.approx(float(sums.group(2)), rel=1e-5)  # the fused RMSNorm
    scale = re.search(r"scale = 1/sqrt\(sq / K \+ eps\) = ([\d.]+)   NumPy 1/rms: ([\d.]+)", out)
    assert scale and float(scale.group(1)) == pytest.approx(float(scale.group(2)), rel=1e-5)
    assert "this thread merged out[0, 2, 3]" in out and "the decode step predicted token" in out
    out = step_through("--kernel", "model", commands="c\n" * 4)
    assert out.count("stopped in gemv_kernel") == 2 and out.count("stopped in decode_attention_kernel") == 2
    assert "the decode step predicted token" in out
