"""`numba-vllm bench ... --plot` (numba_vllm/viz/bench_plots.py): latency and throughput on the numpy
backend with a tiny random model, kernels from a JSON table written here (the kernels themselves need a
GPU); the roofline's coordinates against flops and bytes worked out by hand; one-line errors."""

import importlib.util
import json

import pytest
from click.testing import CliRunner

from numba_vllm.cli import main
from tests.helpers.tiny_llama import tiny_config_dict

pytestmark = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib (the plot extra) is missing")


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg")
    (path / "config.json").write_text(json.dumps(tiny_config_dict()))
    return path


def bench(*args):
    return CliRunner().invoke(main, ["bench", *args])


def assert_image(path, min_width=600):
    from matplotlib.image import imread

    image = imread(path)
    assert image.ndim == 3 and image.shape[1] >= min_width
    assert image[..., :3].std() > 0.05  # something drawn, not a blank canvas


def test_latency_plot(config_dir, tmp_path):
    r = bench("latency", "--random-weights", str(config_dir), "--backend", "numpy", "--batch-sizes", "1,2,4",
              "--prompt-len", "5", "--output-len", "4", "--num-pages", "32", "--plot", str(tmp_path / "lat.png"))  # fmt: skip
    assert r.exit_code == 0, r.output
    assert_image(tmp_path / "lat.png")


def test_throughput_keeps_every_step_and_plots_both_schedulers(config_dir, tmp_path):
    out = tmp_path / "tp.json"
    r = bench("throughput", "--random-weights", str(config_dir), "--backend", "numpy", "--num-requests", "6",
              "--min-prompt-len", "3", "--max-prompt-len", "12", "--min-output-len", "2", "--max-output-len", "8",
              "--max-num-seqs", "3", "--json", str(out), "--plot", str(tmp_path / "tp.svg"))  # fmt: skip
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    for run in res["runs"].values():
        steps = run["per_step"]
        # One entry per engine.step() call: with overlapped scheduling a call may only collect (the last).
        assert len(steps["end_s"]) == len(steps["generated"]) == len(steps["ms"]) >= run["steps"]
        assert sum(steps["generated"]) == run["output_tokens"]
        assert all(0 <= n <= 3 for n in steps["generated"])  # at most one token per batch slot
        assert steps["end_s"] == sorted(steps["end_s"]) and steps["end_s"][-1] <= run["elapsed_s"] + 1e-3
        assert sum(steps["ms"]) / 1e3 <= run["elapsed_s"] + 1e-3
    svg = (tmp_path / "tp.svg").read_text()
    assert svg.startswith("<?xml") and "continuous" in svg and "static" in svg


# Two rows written by hand: a decode gemv reading 2048x2048 bf16 weights in 5 us, and a tensor-core
# GEMM 4096x2048 @ 2048x8192 in 670 us; an embedding lookup that computes nothing.
GEMV_BYTES, GEMV_FLOPS, GEMV_S = 2048 * 2048 * 2 + 2048 * 4 * 2, 2 * 2048 * 2048, 5e-6
GEMM_BYTES, GEMM_FLOPS, GEMM_S = (4096 * 2048 + 2048 * 8192) * 2 + 4096 * 8192 * 4, 2 * 4096 * 2048 * 8192, 670e-6


def _row(name, shape, nbytes, flops, seconds, bound, ceiling):
    gbps, tflops = nbytes / seconds / 1e9, flops / seconds / 1e12
    share = gbps / ceiling if bound == "memory" else tflops / 67.0
    return dict(name=name, shape=shape, us=seconds * 1e6, GBps=gbps, TFLOPs=tflops, bound=bound, of_ceiling=share, torch_us=None)


KERNELS = {
    "benchmark": "kernels",
    "device": "NVIDIA H200",
    "timing": "CUPTI kernel time",
    "iters": 10,
    "ceilings": {"copy_GBps": 4200.0, "fp32_TFLOPs": 67.0, "bf16_mma_TFLOPs": 791.0},
    "rows": [
        _row("gemv", "M=1 N=2048 K=2048", GEMV_BYTES, GEMV_FLOPS, GEMV_S, "memory", 4200.0),
        _row("gemm_tc", "M=4096 N=8192 K=2048", GEMM_BYTES, GEMM_FLOPS, GEMM_S, "fp32", 4200.0),
        _row("embedding", "T=4096", 4096 * 2048 * 2 * 2, 0, 26e-6, "memory", 4200.0),
    ],
}


def test_kernels_from_json_prints_the_table_and_draws_the_roofline(tmp_path):
    from numba_vllm.viz.bench_plots import roofline_points

    saved = tmp_path / "kernels.json"
    saved.write_text(json.dumps(KERNELS))
    r = bench("kernels", "--from-json", str(saved), "--plot", str(tmp_path / "roof.png"))
    assert r.exit_code == 0, r.output
    names = [line.split()[0] for line in r.stdout.splitlines()[1:]]
    assert "NVIDIA H200" in r.stdout and names == ["gemv", "gemm_tc", "embedding"]
    assert_image(tmp_path / "roof.png", min_width=1000)
    points = roofline_points(KERNELS)  # the embedding computes nothing: not on a log-log roofline
    assert [p[0] for p in points] == ["gemv M=1 N=2048 K=2048", "gemm_tc M=4096 N=8192 K=2048"]
    assert points[0][1] == pytest.approx(GEMV_FLOPS / GEMV_BYTES) and points[1][1] == pytest.approx(GEMM_FLOPS / GEMM_BYTES)
    assert points[1][2] == pytest.approx(GEMM_FLOPS / GEMM_S / 1e12)

    r = bench("kernels", "--from-json", str(saved), "--only", "gemm")
    assert r.exit_code == 0 and [line.split()[0] for line in r.stdout.splitlines()[1:]] == ["gemm_tc"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["kernels", "--plot", "x.gif", "--from-json", "{json}"], "the file name must end in .png, .svg, .pdf"),
        (["kernels", "--static", "--plot", "x.png"], "--static reports resources, not timings"),
        (["kernels", "--from-json", "{bad}"], "is not a `bench kernels --json` result"),
        (["latency", "--random-weights", "{cfg}", "--backend", "numpy", "--plot", "x.txt"], "the file name must end in .png"),
    ],
)
def test_plot_mistakes_are_one_line_errors(tmp_path, config_dir, args, message):
    (tmp_path / "k.json").write_text(json.dumps(KERNELS))
    (tmp_path / "bad.json").write_text(json.dumps({"benchmark": "latency"}))
    paths = {"json": str(tmp_path / "k.json"), "bad": str(tmp_path / "bad.json"), "cfg": str(config_dir)}
    r = bench(*[a.format(**paths) for a in args])
    assert r.exit_code != 0 and message in r.output and "Traceback" not in r.output


def test_plot_result_names_what_it_cannot_draw(tmp_path):
    from numba_vllm.viz.bench_plots import plot_result

    with pytest.raises(ValueError, match="cannot plot a result of benchmark 'serve'"):
        plot_result({"benchmark": "serve"}, tmp_path / "x.png")
