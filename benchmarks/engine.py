"""The engine benchmark of earlier figures: `numba-vllm bench throughput` with that run's defaults.

    python benchmarks/engine.py --num-requests 64 --max-num-seqs 64
    python benchmarks/engine.py --num-requests 256 --max-num-seqs 256 --num-pages 1200 [--json out.json]

One implementation: this only calls `numba-vllm bench throughput` (numba_vllm/bench/throughput.py),
starting from the defaults the measurements in docs/benchmarks.md ("Engine, earlier measurements")
were taken with: random weights with Llama 3.2 1B's config, 64 requests and 64 slots, prompts of
16-512 and outputs of 16-256 tokens, continuous scheduling. Any `bench throughput` option given here
overrides them (`--help` lists them); the old names --config-dir, --min-prompt, --max-prompt,
--min-output and --max-output are still understood.
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from numba_vllm.cli import main  # noqa: E402

EARLIER_DEFAULTS = [
    "--num-requests", "64", "--max-num-seqs", "64", "--scheduling", "continuous",
    "--min-prompt-len", "16", "--max-prompt-len", "512", "--min-output-len", "16", "--max-output-len", "256",
]  # fmt: skip
OLD_NAMES = {
    "--config-dir": "--random-weights",
    "--min-prompt": "--min-prompt-len",
    "--max-prompt": "--max-prompt-len",
    "--min-output": "--min-output-len",
    "--max-output": "--max-output-len",
}


def translate(args: list[str]) -> list[str]:
    out = []
    for a in args:
        name, eq, value = a.partition("=")
        out.append(OLD_NAMES.get(name, name) + eq + value)
    if not any(a.partition("=")[0] in ("--model", "-m", "--random-weights") for a in out):
        out = ["--random-weights", str(REPO / "tests/data/llama-3.2-1b-instruct"), *out]
    return out


if __name__ == "__main__":
    main(["bench", "throughput", *EARLIER_DEFAULTS, *translate(sys.argv[1:])], prog_name="benchmarks/engine.py")
