"""benchmarks/serve.py's summary: percentiles and goodput against service-level objectives."""

import importlib.util
import sys
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("serve_bench", Path(__file__).parents[1] / "benchmarks" / "serve.py")
serve_bench = sys.modules["serve_bench"] = importlib.util.module_from_spec(spec)  # dataclasses look the module up
spec.loader.exec_module(serve_bench)
Result = serve_bench.Result


def test_goodput_counts_the_requests_that_met_every_objective():
    results = [
        Result(ok=True, output_tokens=11, ttft=0.2, e2e=0.2 + 10 * 0.010),  # tpot 10 ms: good
        Result(ok=True, output_tokens=11, ttft=0.9, e2e=0.9 + 10 * 0.010),  # ttft too slow
        Result(ok=True, output_tokens=21, ttft=0.1, e2e=0.1 + 20 * 0.020),  # tpot 20 ms: too slow
        Result(ok=False, error="HTTP 500"),
    ]
    s = serve_bench.summarize(results, wall=2.0, not_run=0, slo_ms={"ttft": 600.0, "tpot": 12.0})
    assert s["requests_ok"] == 3 and s["requests_failed"] == 1
    assert s["goodput"]["requests"] == 1
    assert s["goodput"]["requests_per_s"] == pytest.approx(0.5)
    assert s["goodput"]["output_tokens_per_s"] == pytest.approx(5.5)
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert "goodput" not in serve_bench.summarize(results, wall=2.0, not_run=0)


def test_slo_specs():
    assert serve_bench.parse_slos(["ttft=600", "tpot=12.5"]) == {"ttft": 600.0, "tpot": 12.5}
    for bad in (["ttft"], ["itl=3"], ["tpot=fast"]):
        with pytest.raises(ValueError):
            serve_bench.parse_slos(bad)
