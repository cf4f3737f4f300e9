"""The kernel resource report (``numba_vllm/bench/kernel_report.py``): occupancy arithmetic against
hand-computed cases, ptxas output parsing, and, over the whole registry with the ptxas matching
numba-cuda's NVVM (the ``nvidia-cuda-nvcc`` wheel of the dev extra; skipped without one), that every
variant can launch and no hot kernel spills to local memory.

Hand-computed occupancy on an H200 SM (65536 registers in 4 quarters of 16384, given to warps in
units of 256; 233472 bytes of shared memory, 1024 reserved per block, in units of 128; 64 warps;
32 blocks).
"""

import re
from pathlib import Path

import pytest

from numba_vllm.bench import kernel_report
from numba_vllm.bench.kernel_report import REGISTRY, Resources, occupancy, parse_ptxas
from tests.helpers import ptx as ptx_check


@pytest.mark.parametrize(
    "registers, shared, threads, blocks, limit, warps",
    [
        # 245 x 32 = 7840 -> 7936 a warp; 16384 // 7936 = 2 warps a quarter, 8 an SM: one 8-warp block
        (245, 49152, 256, 1, "registers", 8),
        # 32 x 32 = 1024 a warp: 64 warps by registers; 2048 threads // 256 = 8 blocks: full
        (32, 0, 256, 8, "threads", 64),
        # 64 registers, 1024 threads: 2048 a warp, 8 a quarter, 32 an SM: exactly one block (threads allow 2)
        (64, 0, 1024, 1, "registers", 32),
        # 65 registers: 2080 -> 2304 a warp, 7 a quarter, 28 an SM < 32 warps: the block cannot launch
        (65, 0, 1024, 0, "registers", 0),
        # one warp of 16 registers: 512 a warp, 128 warps; 64 blocks by threads; the 32-block cap binds
        (16, 0, 32, 32, "blocks", 32),
        # 100 KB + 1 KB reserved = 103424 a block: 233472 // 103424 = 2 blocks of 4 warps
        (32, 102400, 128, 2, "shared", 8),
        # 40 registers: 1280 a warp, 12 a quarter, 48 an SM: 12 blocks of 4 warps (shared memory:
        # 1000 + 1024 -> 2048 a block, 114 blocks; threads: 16)
        (40, 1000, 128, 12, "registers", 48),
        # 152 registers: 4864 a warp, 3 a quarter (not 65536 // 4864 = 13): 12 warps, 3 blocks of 4
        (152, 0, 128, 3, "registers", 12),
        # past 227 KB a block cannot launch, however small
        (32, 227 * 1024 + 1, 32, 0, "shared", 0),
        # 48 threads take 2 warps: 32 blocks by threads, by the cap and by registers; threads named first
        (32, 0, 48, 32, "threads", 64),
    ],
)
def test_occupancy_matches_hand_computed_cases(registers, shared, threads, blocks, limit, warps):
    occ = occupancy(registers, shared, threads)
    assert (occ.blocks, occ.limit, occ.warps) == (blocks, limit, warps)
    assert occ.fraction == warps / 64


def test_occupancy_reports_each_limit():
    occ = occupancy(128, 16896, 128)  # decode attention g4 hd64 under its 128-register cap
    # 4096 a warp: 4 a quarter, 16 an SM -> 4 blocks; 16896 + 1024 = 17920: 13 blocks; 16 by threads
    assert (occ.by_registers, occ.by_shared, occ.by_threads, occ.blocks, occ.warps) == (4, 13, 16, 4, 16)


PTXAS_OUTPUT = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_ZN6cudapy8numba_vllm7kernels4gemm11gemm_kernel' for 'sm_90'
ptxas info    : Function properties for _ZN6cudapy8numba_vllm7kernels4gemm11gemm_kernel
    40 bytes stack frame, 44 bytes spill stores, 36 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 33792 bytes smem, 416 bytes cmem[0]
"""


def test_ptxas_output_is_parsed():
    assert parse_ptxas(PTXAS_OUTPUT) == Resources(registers=128, spill_stores=44, spill_loads=36, stack=40, shared=33792)
    no_smem = PTXAS_OUTPUT.replace(", 33792 bytes smem", "")
    assert parse_ptxas(no_smem).shared == 0


def test_missing_ptxas_is_one_line_naming_the_wheel(monkeypatch):
    def not_installed(name):
        raise kernel_report.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(kernel_report.importlib.metadata, "distribution", not_installed)
    monkeypatch.setattr(kernel_report.shutil, "which", lambda name: None)
    with pytest.raises(kernel_report.ReportError, match="nvidia-cuda-nvcc") as e:
        kernel_report.find_ptxas()
    assert "\n" not in str(e.value)


def test_registry_lists_every_kernel_of_the_package():
    """Every kernel of numba_vllm/kernels/ (a ``@kernel`` function, or a copy built with ``kernel(...)``) has a variant."""
    kernels_dir = Path(kernel_report.__file__).resolve().parents[1] / "kernels"
    defined = set()
    for source in kernels_dir.glob("*.py"):
        defined |= set(re.findall(r"^\s*@kernel\b.*\n\s*def (\w+)_kernel\(|^(\w+)_kernel = kernel\(", source.read_text(), re.M))
    names = {(a or b).lstrip("_") for a, b in defined}
    assert names == {v.name for v in REGISTRY}
    assert len({v.key for v in REGISTRY}) == len(REGISTRY)


@pytest.fixture(scope="module")
def report():
    try:
        ptxas = kernel_report.find_ptxas()
    except kernel_report.ReportError as e:
        pytest.skip(str(e))
    return kernel_report.kernel_report(REGISTRY, ptx=ptx_check.compile_ptx(REGISTRY), ptxas=ptxas)


@pytest.mark.slow  # compiles and assembles every variant: 300 s on one core when no other worker shares the compiles
@pytest.mark.timeout(900)
def test_every_variant_launches_and_no_hot_kernel_spills(report):
    rows = {f"{r['kernel']} {r['variant']}".strip(): r for r in report["rows"]}
    cannot_launch = [key for key, r in rows.items() if r["blocks"] < 1]
    assert cannot_launch == []  # too many registers or too much shared memory for its block size
    for v in REGISTRY:
        r = rows[v.key]
        if v.hot:
            local = {part: r[part] for part in ("spill_stores", "spill_loads", "stack")}  # bytes per thread
            assert max(local.values()) <= v.spill_budget, f"{v.key}: {local}"
        if r["max_registers"]:
            assert r["registers"] <= r["max_registers"]


@pytest.mark.slow
def test_static_report_command_prints_and_writes_json(tmp_path):
    from click.testing import CliRunner

    from numba_vllm.cli import main

    try:
        kernel_report.find_ptxas()
    except kernel_report.ReportError as e:
        pytest.skip(str(e))
    out = tmp_path / "report.json"
    result = CliRunner().invoke(main, ["bench", "kernels", "--static", "--only", "reduce_parts", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert re.search(r"^reduce_parts\s+-\s+\d+", result.output, re.M)
    assert '"kernel": "reduce_parts"' in out.read_text()
