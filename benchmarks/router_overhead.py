"""What the router costs: `benchmarks/serve.py` against one replica directly and through vllm-router.

    python benchmarks/router_overhead.py --rounds 2 --json overhead.json \\
        --bench "-n 512 -c 256 --prompt-len 100 1024 --output-len 256" -- \\
        --model tests/data/llama-3.2-1b-instruct --load-format dummy --backend cuda --max-num-seqs 256 \\
        --no-enable-prefix-caching

starts a fleet of one replica (`numba_vllm.fleet`, so the replica is warmed up once and serves both
sides), then runs `benchmarks/serve.py BENCH` alternately against the replica's own URL and the
router's, `--rounds` times each (direct first in even rounds, the router first in odd ones, so that
neither side always runs on the warmer server). After every run it prints (and writes to `--json`)
the runs so far and the median of each side: output tokens/s, TTFT and TPOT p50, the router's
throughput as a fraction of the direct one, and the median of the rounds' own ratios. The fleet is
stopped at the end (or on Ctrl-C).

Every run sends the same prompts: give the replica `--no-enable-prefix-caching` so that later runs do
not find the earlier runs' prompts cached (with caching on, the first run alone prefills them).

With `--gpus 0,1,...` the fleet has a replica per GPU: "direct" is then the first replica alone and
"router" all of them behind the router, which measures the scaling.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from numba_vllm.fleet import Fleet, FleetSpec  # noqa: E402


def run_bench(url: str, bench_args: list[str]) -> dict:
    """One `benchmarks/serve.py` run against `url`: its JSON summary."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "summary.json"
        cmd = [sys.executable, str(ROOT / "benchmarks" / "serve.py"), "--base-url", url, *bench_args, "--json", str(out)]
        print("running:", " ".join(cmd), file=sys.stderr, flush=True)
        subprocess.run(cmd, check=False)  # serve.py exits 1 if a request failed; its summary says which
        return json.loads(out.read_text())


def row(side: str, s: dict) -> str:
    return (
        f"{side:<8}{s['output_tokens_per_s']:>12.1f}{s['ttft_ms']['p50']:>12.1f}{s['tpot_ms']['p50']:>12.2f}"
        f"{s['requests_ok']:>8d}{s['requests_failed']:>8d}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", default="-n 512 -c 256 --prompt-len 100 1024 --output-len 256", help="benchmarks/serve.py options")
    ap.add_argument("--rounds", type=int, default=2, help="runs on each side, alternating (direct first, then router first)")
    ap.add_argument("--port", type=int, default=8000, help="the router's; the replicas use the next ones")
    ap.add_argument("--gpus", default=None, help="comma-separated GPU ids, a replica each (default: one replica)")
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--json", default=None, help="write every run's summary and the medians here")
    ap.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then `numba-vllm serve` options")
    args = ap.parse_args()
    serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    bench_args = shlex.split(args.bench)

    gpus = None if args.gpus is None else args.gpus.split(",")
    fleet = Fleet(FleetSpec(serve_args=serve_args, replicas=1, gpus=gpus, port=args.port))
    runs: dict[str, list[dict]] = {"direct": [], "router": []}
    try:
        fleet.start(args.start_timeout)
        urls = {"direct": fleet.spec.worker_urls[0], "router": fleet.spec.url}
        for i in range(args.rounds):
            for side in ("direct", "router") if i % 2 == 0 else ("router", "direct"):
                runs[side].append(run_bench(urls[side], bench_args))
                report(runs, args.json)  # after every run: a run cut short by a time limit keeps the others
    finally:
        fleet.stop()


def report(runs: dict[str, list[dict]], json_path: str | None) -> None:
    """Print every run so far and, once both sides have one, the medians; write them to `json_path`."""
    print(f"\n{'':<8}{'out tok/s':>12}{'TTFT p50':>12}{'TPOT p50':>12}{'ok':>8}{'failed':>8}")
    for i in range(len(runs["direct"])):
        for side in ("direct", "router"):
            if i < len(runs[side]):
                print(row(side, runs[side][i]))
    summary: dict = {"runs": runs}
    if runs["router"]:
        medians = {side: statistics.median(r["output_tokens_per_s"] for r in runs[side]) for side in runs}
        ratio = medians["router"] / medians["direct"]
        summary.update(median_output_tokens_per_s=medians, router_over_direct=ratio)
        rounds = zip(runs["direct"], runs["router"], strict=False)  # a run cut short leaves one side a run behind
        paired = [r["output_tokens_per_s"] / d["output_tokens_per_s"] for d, r in rounds]
        summary.update(round_ratios=paired, median_round_ratio=statistics.median(paired))
        print(f"median output tokens/s: direct {medians['direct']:.1f}, router {medians['router']:.1f} ({ratio:.1%}); "
              f"rounds: router/direct {', '.join(f'{p:.1%}' for p in paired)} (median {statistics.median(paired):.1%})")
    sys.stdout.flush()
    if json_path:
        Path(json_path).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
