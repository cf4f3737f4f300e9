"""`numba-vllm bench`: latency and throughput smoke runs on the NumPy backend with a tiny random
Llama (through click's CliRunner, JSON checked), and one-line errors for bad options, a missing GPU
and a missing transformers."""

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from numba_vllm.bench.common import format_table, weight_bytes_per_decode_step
from numba_vllm.bench.throughput import offline_workload
from numba_vllm.cli import main
from numba_vllm.model.config import ModelConfig
from tests.helpers.tiny_llama import tiny_config_dict

REPO = Path(__file__).resolve().parents[1]
# tiny_config_dict()'s parameters, counted by hand: per layer q, o (64 x 64), k, v (32 x 64), gate, up,
# down (96 x 64) and two norms (64); then the tied embedding (128 x 64, read once, as the head) and the
# final norm. A decode step reads each once, in bf16.
TINY_PARAMS = 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 96 * 64 + 2 * 64) + 128 * 64 + 64


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_config")
    (path / "config.json").write_text(json.dumps(tiny_config_dict()))
    return path


def bench(*args):
    return CliRunner().invoke(main, ["bench", *args])


def test_latency_smoke_on_numpy(config_dir, tmp_path):
    out = tmp_path / "latency.json"
    r = bench("latency", "--random-weights", str(config_dir), "--backend", "numpy", "--batch-sizes", "1,3",
              "--prompt-len", "9", "--output-len", "5", "--num-pages", "64", "--peak-bandwidth-tbs", "2",
              "--json", str(out))  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "decode ms/step" in r.stdout and "batch-1 floor" in r.stdout
    res = json.loads(out.read_text())
    assert res["benchmark"] == "latency" and res["backend"] == "numpy"
    assert res["workload"]["batch_sizes"] == [1, 3] and res["workload"]["prompt_len"] == 9
    assert [row["batch_size"] for row in res["results"]] == [1, 3]
    for row in res["results"]:
        assert row["output_tokens"] == row["batch_size"] * 5
        assert row["decode_steps"] == 4  # one prefill step gives the first token, then 4 decode steps
        assert row["preemptions"] == 0
        assert 0 < row["ttft_ms"] and 0 < row["decode_ms_median"] <= row["decode_ms_p90"]
        assert row["decode_tokens_per_s"] == pytest.approx(row["batch_size"] / (row["decode_ms_median"] / 1e3))
    assert res["weight_bytes"] == 2 * TINY_PARAMS
    assert res["batch1_floor_ms"] == pytest.approx(2 * TINY_PARAMS / 2e12 * 1e3)  # the bytes at the given 2 TB/s
    assert res["batch1_ratio_to_floor"] == pytest.approx(res["results"][0]["decode_ms_median"] / res["batch1_floor_ms"])
    assert res["load_s"] >= 0 and res["warmup_s"] > 0 and "hf" not in res


def test_throughput_smoke_on_numpy_both_schedulers(config_dir, tmp_path):
    out = tmp_path / "throughput.json"
    r = bench("throughput", "--random-weights", str(config_dir), "--backend", "numpy", "--num-requests", "7",
              "--min-prompt-len", "3", "--max-prompt-len", "20", "--min-output-len", "2", "--max-output-len", "9",
              "--max-num-seqs", "4", "--seed", "3", "--json", str(out))  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "continuous" in r.stdout and "static" in r.stdout and "output tokens/s" in r.stdout
    res = json.loads(out.read_text())
    want = offline_workload(7, 3, (3, 20), (2, 9), vocab_size=128)
    assert res["workload"]["num_requests"] == 7
    assert res["workload"]["prompt_tokens"] == want.prompt_tokens
    assert res["workload"]["output_tokens"] == want.output_tokens == sum(want.output_lens)
    assert set(res["runs"]) == {"continuous", "static"}
    for mode, run in res["runs"].items():
        assert run["scheduling"] == mode
        assert run["output_tokens"] == want.output_tokens  # every request generated exactly its length
        assert run["prompt_tokens"] == want.prompt_tokens
        assert run["output_tokens_per_s"] == pytest.approx(run["output_tokens"] / run["elapsed_s"])
        assert run["total_tokens_per_s"] == pytest.approx((run["output_tokens"] + run["prompt_tokens"]) / run["elapsed_s"])
        assert run["steps"] >= max(want.output_lens) and run["preemptions"] >= 0 and run["median_step_ms"] > 0
        assert run["peak_device_memory_GiB"] is None  # no device on the numpy backend
    # static batching waits for a batch's longest request before admitting anyone: never fewer steps
    assert res["runs"]["static"]["steps"] >= res["runs"]["continuous"]["steps"]
    assert res["continuous_vs_static"] == pytest.approx(
        res["runs"]["continuous"]["output_tokens_per_s"] / res["runs"]["static"]["output_tokens_per_s"]
    )


@pytest.fixture(scope="module")
def long_config_dir(tmp_path_factory):
    """The tiny model with room for the prefix-caching target's 1024 + 64 + 128 tokens."""
    path = tmp_path_factory.mktemp("tiny_long_config")
    (path / "config.json").write_text(json.dumps(tiny_config_dict(max_position_embeddings=2048)))
    return path


# The H200 targets' command lines (docs/benchmarks.md), cut down only in requests and output tokens.
SHARED_PREFIX_TARGET = ["--scheduling", "continuous", "--num-requests", "256", "--shared-prefix-len", "1024",
                        "--min-prompt-len", "64", "--max-prompt-len", "64", "--min-output-len", "128", "--max-output-len", "128"]
NO_SHARING_TARGET = ["--scheduling", "continuous", "--compare-prefix-caching"]


def smoke(args: list[str], **replace: str) -> list[str]:
    """`args` with the values of some options replaced (`num_requests="4"` sets --num-requests 4)."""
    args = list(args)
    for name, value in replace.items():
        args[args.index("--" + name.replace("_", "-")) + 1] = value
    return args


def test_shared_prefix_target_smoke_on_numpy(long_config_dir, tmp_path):
    out = tmp_path / "prefix.json"
    args = smoke(SHARED_PREFIX_TARGET, num_requests="3", min_output_len="3", max_output_len="3")
    r = bench("throughput", "--random-weights", str(long_config_dir), "--backend", "numpy", *args, "--json", str(out))
    assert r.exit_code == 0, r.output
    assert "prefix caching on / off: output tokens/s" in r.stdout and "TTFT p50 ms" in r.stdout
    res = json.loads(out.read_text())
    assert res["workload"]["shared_prefix_len"] == 1024 and res["workload"]["prompt_tokens"] == 3 * (1024 + 64)
    assert set(res["runs"]) == {"continuous, caching on", "continuous, caching off"}
    on, off = res["runs"]["continuous, caching on"], res["runs"]["continuous, caching off"]
    assert (on["prefix_caching"], off["prefix_caching"]) == (True, False)
    assert on["output_tokens"] == off["output_tokens"] == 3 * 3
    # The 2048-token budget admits the first prompt (1088 tokens) and 960 of the second in step 1;
    # the third, admitted later, finds the prefix's 64 pages cached.
    assert on["cached_prompt_tokens"] == 1024 and off["cached_prompt_tokens"] == 0
    assert on["prefix_cache_hit_rate"] == pytest.approx(1024 / (3 * 1088)) and off["prefix_cache_hit_rate"] == 0
    assert 0 < on["ttft_p50_ms"] <= on["ttft_p90_ms"] and 0 < off["ttft_p50_ms"] <= off["ttft_p90_ms"]
    ratios = res["caching_on_vs_off"]["continuous"]
    assert ratios["output_tokens_per_s"] == pytest.approx(on["output_tokens_per_s"] / off["output_tokens_per_s"])
    assert ratios["ttft_p50_lower"] == pytest.approx(off["ttft_p50_ms"] / on["ttft_p50_ms"])


def test_no_sharing_target_smoke_on_numpy(config_dir, tmp_path):
    out = tmp_path / "plain.json"
    args = [*NO_SHARING_TARGET, "--num-requests", "5", "--min-prompt-len", "3", "--max-prompt-len", "40",
            "--min-output-len", "2", "--max-output-len", "6"]  # fmt: skip
    r = bench("throughput", "--random-weights", str(config_dir), "--backend", "numpy", *args, "--json", str(out))
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    assert res["workload"]["shared_prefix_len"] == 0
    on, off = res["runs"]["continuous, caching on"], res["runs"]["continuous, caching off"]
    assert on["output_tokens"] == off["output_tokens"] and on["steps"] == off["steps"]
    assert on["cached_prompt_tokens"] == 0  # random prompts share no full page


def test_one_run_follows_the_prefix_caching_switch(config_dir, tmp_path):
    out = tmp_path / "off.json"
    r = bench("throughput", "--random-weights", str(config_dir), "--backend", "numpy", "--num-requests", "2",
              "--min-prompt-len", "4", "--max-prompt-len", "6", "--min-output-len", "2", "--max-output-len", "3",
              "--scheduling", "continuous", "--no-enable-prefix-caching", "--json", str(out))  # fmt: skip
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    assert list(res["runs"]) == ["continuous"] and res["runs"]["continuous"]["prefix_caching"] is False
    assert res["engine"]["enable_prefix_caching"] is False and "caching_on_vs_off" not in res


def test_throughput_one_scheduling_mode(config_dir):
    r = bench("throughput", "--random-weights", str(config_dir), "--backend", "numpy", "--num-requests", "3",
              "--min-prompt-len", "4", "--max-prompt-len", "6", "--min-output-len", "2", "--max-output-len", "3",
              "--scheduling", "static")  # fmt: skip
    assert r.exit_code == 0, r.output
    header = next(line for line in r.stdout.splitlines() if "static" in line and "requests" not in line)
    assert "continuous" not in header


def test_throughput_repeats_report_the_median_run_and_every_run(config_dir, tmp_path):
    """--repeat 3: each run on a fresh engine; the column is the run of the median tokens/s, and every
    run's tokens/s, median step and TTFT p50 are kept beside it, their range in the table."""
    out = tmp_path / "throughput.json"
    r = bench("throughput", "--random-weights", str(config_dir), "--backend", "numpy", "--num-requests", "3",
              "--min-prompt-len", "4", "--max-prompt-len", "6", "--min-output-len", "2", "--max-output-len", "3",
              "--scheduling", "continuous", "--repeat", "3", "--json", str(out))  # fmt: skip
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    run = res["runs"]["continuous"]
    rates = run["repeats"]["output_tokens_per_s"]
    assert res["repeat"] == 3 and len(rates) == 3 and len(run["repeats"]["median_step_ms"]) == 3
    assert run["output_tokens_per_s"] == sorted(rates)[1]
    assert run["ttft_p50_ms"] == run["repeats"]["ttft_p50_ms"][rates.index(sorted(rates)[1])]  # one run's figures
    assert run["repeats"]["spread"] == pytest.approx((max(rates) - min(rates)) / sorted(rates)[1])
    assert "median output tokens/s of 3" in r.stdout
    assert re.search(r"^output tokens/s, runs\s+[\d.,]+-[\d.,]+ \(\d+\.\d%\)$", r.stdout, re.M), r.stdout
    r = bench("throughput", "--random-weights", str(config_dir), "--backend", "numpy", "--repeat", "0")
    assert r.exit_code != 0 and "0 is not in the range x>=1" in r.output


def test_workload_is_seeded_and_in_range():
    a = offline_workload(50, 0, (100, 1024), (100, 1024), vocab_size=128256)
    b = offline_workload(50, 0, (100, 1024), (100, 1024), vocab_size=128256)
    assert a == b and a != offline_workload(50, 1, (100, 1024), (100, 1024), vocab_size=128256)
    assert all(100 <= len(p) <= 1024 for p in a.prompts) and all(100 <= n <= 1024 for n in a.output_lens)
    assert all(0 <= t < 10000 for p in a.prompts for t in p)
    assert all(0 <= t < 50 for p in offline_workload(5, 0, (10, 20), (1, 2), vocab_size=50).prompts for t in p)
    shared = offline_workload(50, 0, (100, 1024), (100, 1024), vocab_size=128256, shared_prefix_len=1024)
    assert shared.output_lens == a.output_lens and shared.shared_prefix_len == 1024
    assert all(p[:1024] == shared.prompts[0][:1024] and p[1024:] == own for p, own in zip(shared.prompts, a.prompts, strict=True))


def test_compare_hf_without_transformers_is_a_clear_error(config_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    for command in ("latency", "throughput"):
        r = bench(command, "--random-weights", str(config_dir), "--backend", "numpy", "--compare-hf")
        assert r.exit_code == 1, r.output
        assert "--compare-hf needs torch and transformers" in r.output and "Traceback" not in r.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["latency", "--backend", "numpy"], "give exactly one of --model PATH or --random-weights CONFIG_DIR"),
        (["latency", "--batch-sizes", "1,x"], "is not a comma-separated list of integers"),
        (["latency", "--batch-sizes", "2,2"], "repeats a batch size"),
        (["latency", "--batch-sizes", "1,300"], "batch size 300 is above --max-num-seqs 256"),
        (["latency", "--output-len", "1"], "1 is not in the range x>=2"),
        (["latency", "--prompt-len", "200"], "need 457 positions; the model has max_position_embeddings 256"),
        (["latency", "--hf-compile"], "--hf-compile only applies with --compare-hf"),
        (["latency", "--peak-bandwidth-tbs", "0"], "is not in the range x>0"),
        (["throughput", "--min-output-len", "20", "--max-output-len", "10"], "20 > --max-output-len 10"),
        (["throughput"], "need 2049 positions; the model has max_position_embeddings 256"),
        (["throughput", "--json", "/no/such/dir/out.json"], "no such directory"),
        (["throughput", "--scheduling", "dynamic"], "'dynamic' is not one of"),
        (["throughput", "--shared-prefix-len", "16", "--no-enable-prefix-caching"], "run with prefix caching on and off"),
        (["throughput", "--shared-prefix-len", "-1"], "-1 is not in the range x>=0"),
        (["throughput", "--shared-prefix-len", "200", "--min-prompt-len", "10", "--max-prompt-len", "60", "--min-output-len", "5",
          "--max-output-len", "10"],
         "need 271 positions; the model has max_position_embeddings 256"),
        (["latency", "--backend", "cuda"], "backend 'cuda'"),
    ],
)
def test_bad_options_are_one_line_errors(config_dir, args, message):
    command, rest = args[0], args[1:]
    base = [] if "--backend" in rest and "numpy" in rest else ["--random-weights", str(config_dir)]
    if "--backend" not in rest:
        base += ["--backend", "numpy"]
    r = bench(command, *base, *rest)
    assert r.exit_code != 0 and message in r.output, r.output
    assert "Traceback" not in r.output


def test_kernels_without_a_gpu_is_a_clear_error():
    r = bench("kernels")
    assert r.exit_code == 1 and "the kernel benchmark needs an NVIDIA GPU" in r.output, r.output


def test_weight_bytes_count_the_head_not_an_untied_embedding():
    tied = ModelConfig.from_dict(tiny_config_dict())
    untied = ModelConfig.from_dict(tiny_config_dict(tie_word_embeddings=False))
    assert weight_bytes_per_decode_step(tied) == 2 * tied.num_parameters()
    assert weight_bytes_per_decode_step(untied) == 2 * (untied.num_parameters() - untied.vocab_size * untied.hidden_size)
    assert weight_bytes_per_decode_step(untied) == weight_bytes_per_decode_step(tied)


def test_format_table_aligns_columns():
    text = format_table(["", "a", "bb"], [["x", 1.5, None], ["longer", 1234.5, 3]])
    lines = text.splitlines()
    assert lines[0].rstrip().endswith("bb") and lines[2].split() == ["x", "1.50", "-"]
    assert lines[3].split() == ["longer", "1,234.50", "3"] and len({len(line) for line in lines}) == 1


def test_hf_model_has_the_checkpoints_weights(config_dir, tmp_path):
    """The transformers peer computes the same logits as the NumPy reference (float32, both ties)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import numpy as np

    from numba_vllm.bench import hf
    from numba_vllm.loading.checkpoint import random_checkpoint
    from numba_vllm.model.reference import KVCache, ReferenceModel

    for tied in (True, False):
        d = tmp_path / f"tied_{tied}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps(tiny_config_dict(tie_word_embeddings=tied)))
        ckpt = random_checkpoint(d)
        model, _ = hf.build_model(ckpt, "cpu")
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        ids = np.arange(3, 40) % ckpt.config.vocab_size
        want = ReferenceModel(ckpt.config, ckpt.weights).forward(ids, 0, KVCache(ckpt.config, 64), all_logits=True)
        with torch.no_grad():
            got = model.float()(torch.tensor(ids[None])).logits[0].numpy()
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_profile_decode_script_runs_its_two_passes_on_numpy(config_dir):
    """`make profile`'s workload script (benchmarks/profile_decode.py), without a GPU: the warm-up pass
    and the measured pass each prefill the batch and decode the asked steps."""
    args = ["--config-dir", str(config_dir), "--batch", "2", "--steps", "2", "--prompt-len", "8", "--backend", "numpy"]
    script = str(REPO / "benchmarks" / "profile_decode.py")
    r = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    for name in ("warmup", "run"):
        assert f"{name}: prefill of 2 x 8 tokens" in r.stdout and "decode 2 steps of batch 2" in r.stdout, r.stdout


@pytest.mark.slow  # starts a server process
def test_serve_benchmark_shared_prefix_target_smoke_on_numpy(long_config_dir, tmp_path):
    """benchmarks/serve.py with the target's prefix and prompt lengths, a tiny model on numpy: it starts
    the server twice, with prefix caching and without, and reports both runs and their ratios."""
    pytest.importorskip("fastapi")
    pytest.importorskip("aiohttp")
    out = tmp_path / "serve.json"
    server = f"--model {long_config_dir} --load-format dummy --backend numpy --max-num-seqs 4"
    args = ["-n", "3", "-c", "3", "--shared-prefix-len", "1024", "--prompt-len", "64", "--output-len", "3", "--warmup", "1",
            "--start-server", server, "--json", str(out)]  # fmt: skip
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "serve.py"), *args], capture_output=True, text=True,
                       timeout=600, cwd=REPO)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "== prefix caching on / off: output tokens/s" in r.stdout
    res = json.loads(out.read_text())
    on, off = res["caching on"], res["caching off"]
    assert on["requests_ok"] == off["requests_ok"] == 3 and on["output_tokens"] == off["output_tokens"] == 9
    assert on["config"]["start_server"] == server and off["config"]["start_server"] == server + " --no-enable-prefix-caching"
    # Server counters cover the warm-up request too (64 tokens, no shared prefix).
    assert on["prefix_cache_queries"] == 3 * 1088 + 64 and on["prefix_cache_hits"] > 0 and off["prefix_cache_queries"] == 0
    assert "prefix_cache_hit_rate" not in off
    assert res["caching_on_vs_off"]["ttft_p50_lower"] == pytest.approx(off["ttft_ms"]["p50"] / on["ttft_ms"]["p50"])
    for run in (on, off):  # the server started here: its front end and engine core, and the client
        assert set(run["cpu_cores_used"]) == {"front end", "engine core", "client"}
        assert all(0 <= v <= os.cpu_count() + 0.5 for v in run["cpu_cores_used"].values())
        assert run["cpu_cores_used"]["engine core"] > 0.01  # it computed every token
        assert run["server_ttft_mean_ms"] > 0  # from the server's TTFT histogram
    assert "CPU cores used over the run: front end" in r.stdout


def _benchmark_script(name: str):
    """benchmarks/NAME.py as a module (the scripts are not a package)."""
    import importlib.util

    path = Path(__file__).parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kernel_timeline_counts_busy_time_once_and_the_gaps_between():
    timeline = _benchmark_script("kernel_timeline")
    events = [{"ts": 10, "dur": 5}, {"ts": 0, "dur": 4}, {"ts": 12, "dur": 8}, {"ts": 30, "dur": 1}]  # us, out of order
    busy, span, gaps = timeline.busy_and_gaps(events)
    assert (busy, span, gaps) == (4 + 10 + 1, 31, [6, 10])  # [0, 4), [10, 20) (two overlapping), [30, 31)
    profiled = "numba_vllm::kernels::gemm_wgmma::gemm_wgmma_kernel_for::_3clocals_3e::gemm_wgmma_kernel[abi:v41](Array<f>)"
    assert timeline.short_name(profiled) == "gemm_wgmma_kernel"
    assert timeline.short_name("numba_vllm::kernels::rope::rope_kernel[abi:v3][abi:cw51]") == "rope_kernel"
    assert timeline.short_name("Memcpy HtoD (Pinned -> Device)") == "Memcpy HtoD (Pinned -> Device)"


def test_gemm_bounds_switches_off_exactly_the_wgmma_or_the_copies():
    """benchmarks/gemm_bounds.py's reduced builds: the K step's wgmma loop behind a false constant, or
    the producer's arrival with the byte count replaced by a plain arrival and a skip to the next
    step; each still compiles as Python, and the kernel as it is finds both places once."""
    bounds = _benchmark_script("gemm_bounds")
    source = bounds.KERNEL.read_text()
    product = bounds.reduced_source(source, mma=True, copies=True)
    no_mma = bounds.reduced_source(source, mma=False, copies=True)
    no_copies = bounds.reduced_source(source, mma=True, copies=False)
    assert product == source
    assert "if False:" in no_mma and no_mma.count("mma(acc, smem,") == source.count("mma(acc, smem,")
    assert "mbarrier_arrive_expect_tx(barrier, stage_bytes)" not in no_copies and "mbarrier_arrive(barrier)" in no_copies
    for text in (no_mma, no_copies, bounds.reduced_source(source, mma=False, copies=False)):
        compile(text, "gemm_wgmma.py", "exec")
    assert bounds.parse_shape("256x2048x8192") == (256, 2048, 8192)
    with pytest.raises(argparse.ArgumentTypeError):
        bounds.parse_shape("256x2047x8192")


def test_gemm_plans_tries_only_splits_that_keep_their_parts_and_fit():
    """benchmarks/gemm_plans.py's sweep: a split keeps 4 slices of K a part, twice the SMs' blocks at
    most, its parts within the workspace; extra tilings parse as CONSUMERSxBLOCK_NxSTAGES, one that
    overflows shared memory is refused."""
    from numba_vllm.kernels import gemm_wgmma as gw

    plans = _benchmark_script("gemm_plans")
    none = gw.NO_MULTICAST
    tried = set(plans.candidates(64, 2048, 2048, [gw.TINY, gw.LARGE], [1, 2, 4, 8, 16], 132, 10**9, False))
    assert tried == {(c, s, False, none) for c in (gw.TINY, gw.LARGE) for s in (1, 2, 4, 8)}  # 32 slices
    assert (gw.TINY, 8, False, none) not in set(plans.candidates(512, 2048, 2048, [gw.TINY], [8], 132, 10**9, False))  # 256 x 8
    assert set(plans.candidates(64, 2048, 2048, [gw.TINY], [1, 2], 132, 2 * 32 * 4096 - 1, False)) == {(gw.TINY, 1, False, none)}
    # with --clusters: also 2- and 4-way splits summed in a cluster, where the receive buffer fits (not LARGE)
    clustered = {p for p in plans.candidates(64, 2048, 2048, [gw.TINY, gw.LARGE], [1, 2, 3, 4], 132, 10**9, True) if p[2]}
    assert clustered == {(gw.TINY, 2, True, none), (gw.TINY, 4, True, none)}
    # with --multicast: unsplit tilings in every cluster shape whose tiles the product has (M = 128: two 64-row tiles)
    shared = {p[3] for p in plans.candidates(128, 2048, 2048, [gw.TINY], [1, 2], 132, 10**9, False, gw.MULTICASTS[1:])}
    assert shared == {none, (2, 1), (1, 2), (1, 4), (2, 2)}
    assert plans.plan_name(gw.TINY, 2, True) == "TINY/c2" and plans.plan_name(gw.TINY, 4, False) == "TINY/4"
    assert plans.plan_name(gw.TINY, 1, False, (2, 1)) == "TINY/1m2x1" and plans.parse_multicast("1x2") == (1, 2)
    with pytest.raises(argparse.ArgumentTypeError):
        plans.parse_multicast("3x1")
    assert plans.parse_weight("2048x8192") == (2048, 8192)
    for bad in ("2048", "3x64", "64x12", "ax8"):
        with pytest.raises(argparse.ArgumentTypeError):
            plans.parse_weight(bad)
    assert plans.parse_tiling("1x64x12") == gw.TileConfig(consumers=1, block_n=64, stages=12)
    assert plans.name_of(gw.SMALL_DEEP) == "SMALL_DEEP" and plans.name_of(plans.parse_tiling("1x64x12")) == "1x64x12"
    for bad in ("1x64", "1x60x4", "2x256x6", "axbxc"):
        with pytest.raises(argparse.ArgumentTypeError):
            plans.parse_tiling(bad)
    assert plans.positive("3") == 3
    for bad in ("0", "-2", "x"):  # --tokens, --splits, --iters
        with pytest.raises(argparse.ArgumentTypeError):
            plans.positive(bad)
