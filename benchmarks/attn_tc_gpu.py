"""Tensor-core prefill attention on a GPU: checked against torch, timed beside the CUDA-core kernel
and torch's flash attention, at Llama 3.2 1B's attention shapes (32 query heads, 8 kv heads, head
dim 64, bf16 K/V in 16-token pages with shuffled page ids).

Correctness: per sequence, attention in float64 (torch, explicit causal mask, query rows in chunks)
on the bf16-rounded q and the cache's K/V is the reference; the
tensor-core kernel must stay within the per-element bound of tests/test_prefill_attention_tc.py
(``1.1 * 2^-8 * attention(q, K, |V|) + 2e-6``: P is rounded to bf16). The CUDA-core kernel's error
against the same reference is printed beside it (it keeps q in fp32, so it is off by q's rounding).

Timing: median over ``--reps`` of CUDA events around ``inner`` back-to-back launches (divided by
``inner``), after 3 warm-up launches; no L2 flush (a 2048-token context's K/V, 4 MB, stays in L2
in a real step too). torch: bf16 flash attention on contiguous K/V (``enable_gqa``; a lower-right
causal mask over K/V expanded to 32 heads for the chunk after a cached prefix). The CUDA-core
kernel is checked always and timed with ``--cuda-cores`` (slow: ~80 ms a launch at 16384 tokens).

    python benchmarks/attn_tc_gpu.py [--tilings 2x64q,1x64q,2x32q,2x32,1x64] [--wgmma 2x128s2,2x64s3]
                                     [--cuda-cores] [--json out.json]

A tiling ``MxK`` is warp_m_tiles x block_keys with Q's fragments in registers; ``MxKq`` keeps Q in
shared memory (``prefill_attention_tc``'s ``tiling`` argument; the launcher's default is marked *).
``--wgmma`` adds ``prefill_attention_wgmma`` (H100/H200) in tilings ``CxKsS[bB][o][t][pR][P]``: C
consumer warpgroups, K keys a tile, S stages, B blocks an SM asked for, ``o`` the softmax overlapped
with the previous tile's P V, ``t`` the warpgroups' ping-pong turns, R the registers of a producer
warpgroup, ``P`` a persistent grid (its ``Tiling``; ``""`` leaves it out); the launcher's two (short and
long contexts) are marked *.
Each row of the timing table ends with every tiling's time over torch's.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics

import numpy as np
import torch
from numba import cuda

from numba_vllm.bench.attention_cases import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, _gathered_torch, _random_cache
from numba_vllm.kernels.prefill_attention import prefill_attention
from numba_vllm.kernels.prefill_attention_tc import default_tiling, prefill_attention_tc, prefill_attention_tc_kernel_for
from numba_vllm.kernels.prefill_attention_wgmma import (
    LONG_CONTEXT_TILINGS,
    SHORT_CONTEXT_TILINGS,
    Tiling,
    prefill_attention_wgmma,
    prefill_attention_wgmma_kernel_for,
)

SCALE = 1.0 / np.sqrt(HEAD_DIM)
GROUP = NUM_HEADS // NUM_KV_HEADS
P_BOUND = 1.1 * 2.0**-8
ATOL = 2e-6
# (sequences, new tokens each, cached tokens before them): timed and checked
CASES = [(1, 2048, 0), (8, 512, 0), (1, 16384, 0), (1, 2048, 14000)]
RAGGED = [(0, 1), (100, 412), (3000, 512), (511, 1), (0, 333), (64, 64), (17, 300), (0, 1024)]  # checked only


def make_inputs(rng, seqs):
    """Device inputs of a ragged batch: seqs = [(start, new)]."""
    k_cache, v_cache, tables = _random_cache(rng, [start + n for start, n in seqs])
    cu = np.concatenate([[0], np.cumsum([n for _, n in seqs])]).astype(np.int32)
    q = rng.standard_normal((int(cu[-1]), NUM_HEADS, HEAD_DIM), np.float32)
    return dict(q=q, qd=cuda.to_device(q), k_cache=k_cache, v_cache=v_cache, tables=tables,
                block_tables=cuda.to_device(tables), cu=cu, cu_seqlens=cuda.to_device(cu),
                start_pos=cuda.to_device(np.array([s for s, _ in seqs], np.int32)),
                max_new=max(n for _, n in seqs), seqs=seqs)


def launcher(kernel, inp, out, tiling=None):
    extra = {} if tiling is None else {"tiling": tiling}

    def run():
        kernel(inp["qd"], inp["k_cache"], inp["v_cache"], inp["block_tables"], inp["cu_seqlens"], inp["start_pos"],
               SCALE, out, max_new_tokens=inp["max_new"], **extra)

    return run


def reference(inp, s, rows_per_chunk=1024):
    """(want, bound) for sequence s as (n, H, HD) float32 numpy: attention in float64 (torch, query
    rows in chunks) over the bf16-rounded q and the cache's K/V, and of |V| for the bound."""
    start, n = inp["seqs"][s]
    ctx = start + n
    k, v = _gathered_torch(torch, inp["k_cache"], inp["v_cache"], inp["tables"][s : s + 1], ctx)  # (1, KVH, ctx, HD) bf16
    k = k[0].double().repeat_interleave(GROUP, dim=0)  # (H, ctx, HD)
    v = v[0].double().repeat_interleave(GROUP, dim=0)
    rows = slice(int(inp["cu"][s]), int(inp["cu"][s + 1]))
    q = torch.as_tensor(inp["q"][rows], device="cuda").to(torch.bfloat16).double().transpose(0, 1)  # (H, n, HD)
    want, bound = [], []
    for r0 in range(0, n, rows_per_chunk):
        r1 = min(n, r0 + rows_per_chunk)
        scores = (q[:, r0:r1] @ k.transpose(1, 2)) * SCALE  # (H, rows, ctx)
        later = torch.arange(ctx, device="cuda")[None, :] > (start + torch.arange(r0, r1, device="cuda"))[:, None]
        weights = torch.softmax(scores.masked_fill(later, -torch.inf), dim=-1)
        want.append((weights @ v).transpose(0, 1))
        bound.append((P_BOUND * (weights @ v.abs()) + ATOL).transpose(0, 1))
        del scores, weights
    return torch.cat(want).cpu().numpy(), torch.cat(bound).cpu().numpy()


def check(inp, outs):
    """{name: (max abs error, max error / bound)} over all sequences."""
    result = {name: [0.0, 0.0] for name in outs}
    got = {name: out.copy_to_host() for name, out in outs.items()}
    for s in range(len(inp["seqs"])):
        want, bound = reference(inp, s)
        rows = slice(int(inp["cu"][s]), int(inp["cu"][s + 1]))
        for name, g in got.items():
            err = np.abs(g[rows] - want)
            err = np.where(np.isnan(g[rows]), np.inf, err)
            result[name][0] = max(result[name][0], float(err.max()))
            result[name][1] = max(result[name][1], float((err / bound).max()))
    return result


def time_it(fn, reps, inner):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        for _ in range(inner):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / inner)  # us
    return statistics.median(times)


def torch_flash(inp):
    """torch bf16 SDPA (flash) on the case's K/V gathered contiguous; q random bf16."""
    num_seqs = len(inp["seqs"])
    start, n = inp["seqs"][0]
    kt, vt = _gathered_torch(torch, inp["k_cache"], inp["v_cache"], inp["tables"], start + n)
    qt = torch.randn(num_seqs, NUM_HEADS, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if start == 0:
        return lambda: sdpa(qt, kt, vt, is_causal=True, scale=SCALE, enable_gqa=True)
    from torch.nn.attention.bias import causal_lower_right

    kt, vt = kt.repeat_interleave(GROUP, dim=1), vt.repeat_interleave(GROUP, dim=1)
    mask = causal_lower_right(n, start + n)
    return lambda: sdpa(qt, kt, vt, attn_mask=mask, scale=SCALE)


def _wg_tiling(text: str) -> Tiling:
    """``CxKsS[bB][o][t][pR][P]`` as a Tiling (B blocks an SM asked for; o: the overlapped softmax; t: the
    warpgroups' ping-pong turns; R: a producer warpgroup's registers; P: a persistent grid)."""
    match = re.fullmatch(r"(\d+)x(\d+)s(\d+)(?:b(\d+))?(o?)(t?)(?:p(\d+))?(P?)", text)
    if match is None:
        raise SystemExit(f"--wgmma: {text!r} is not CxKsS[bB][o][t][pR][P]")
    c, k, s, b, o, t, p, persistent = match.groups()
    return Tiling(int(c), int(k), int(s), int(b or 1), o == "o", int(p or 0), t == "t", persistent == "P")


def _wg_name(tiling: Tiling) -> str:
    blocks = f"b{tiling.blocks_per_sm}" if tiling.blocks_per_sm > 1 else ""
    producer = f"p{tiling.producer_registers}" if tiling.producer_registers else ""
    return (f"{tiling.consumers}x{tiling.block_keys}s{tiling.stages}{blocks}{'o' * tiling.overlap}{'t' * tiling.pingpong}"
            f"{producer}{'P' * tiling.persistent}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tilings", default="2x64q,1x64q,2x32q,2x32,1x64", help="warp_m_tiles x block_keys[q], comma-separated")
    parser.add_argument("--wgmma", default="1x64s4b3,1x128s2b2,2x128s2,2x64s3o,2x128s3op24",
                        help="prefill_attention_wgmma tilings: CxKsS[bB][o][t][pR][P] (the docstring), comma-separated")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--cuda-cores", action="store_true", help="also time the CUDA-core kernel (slow at 16384)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    tilings = [(int(t.split("x")[0]), int(t.split("x")[1].rstrip("q")), t.endswith("q")) for t in args.tilings.split(",")]
    default = default_tiling(HEAD_DIM)
    wg_tilings = [_wg_tiling(t) for t in args.wgmma.split(",") if t]
    wg_defaults = (SHORT_CONTEXT_TILINGS[HEAD_DIM], LONG_CONTEXT_TILINGS[HEAD_DIM])  # the launcher's, by context length
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; default tiling {default} (*)")
    rng = np.random.default_rng(0)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "check": {}, "time_us": {}}

    print("## correctness (max abs error, max error / bound; bound = 1.1 * 2^-8 * attention(q, K, |V|) + 2e-6)")
    for label, seqs in [(f"{n}x{p}" + (f"_after{c}" if c else ""), [(c, p)] * n) for n, p, c in CASES] + [("ragged", RAGGED)]:
        inp = make_inputs(rng, seqs)
        outs = {}
        for name, kernel, tiling in [("cuda_cores", prefill_attention, None)] + [
            (f"tc_{m}x{k}{'q' * q}", prefill_attention_tc, (m, k, q)) for m, k, q in tilings
        ] + [(f"wg_{_wg_name(t)}", prefill_attention_wgmma, t) for t in wg_tilings]:
            out = cuda.to_device(np.full(inp["q"].shape, np.nan, np.float32))
            launcher(kernel, inp, out, tiling)()
            outs[name] = out
        cuda.synchronize()
        result = check(inp, outs)
        report["check"][label] = result
        print(f"{label:<20} " + "  ".join(f"{name} {e:.2e} ({r:.2f})" for name, (e, r) in result.items()), flush=True)
        del inp, outs

    print("## resources (as this driver built each tiling)")
    for m, k, q in tilings:
        kernel = prefill_attention_tc_kernel_for(GROUP, HEAD_DIM, m, k, q, NUM_KV_HEADS)
        try:
            regs, local, shared = (kernel.get_regs_per_thread(), kernel.get_local_mem_per_thread(),
                                   kernel.get_shared_mem_per_block())
        except Exception as e:  # an API this numba-cuda lacks: the timing still runs
            regs, local, shared = (f"? ({type(e).__name__})",) * 3
        report.setdefault("resources", {})[f"{m}x{k}{'q' * q}"] = [str(regs), str(local), str(shared)]
        print(f"tc_{m}x{k}{'q' * q:<2} registers {regs}  local bytes {local}  shared bytes {shared}", flush=True)
    for t in wg_tilings:
        kernel = prefill_attention_wgmma_kernel_for(GROUP, HEAD_DIM, t)
        try:
            regs, local = kernel.get_regs_per_thread(), kernel.get_local_mem_per_thread()
        except Exception as e:
            regs, local = (f"? ({type(e).__name__})",) * 2
        report.setdefault("resources", {})[f"wg_{_wg_name(t)}"] = [str(regs), str(local), str(t.shared_bytes(HEAD_DIM))]
        print(f"wg_{_wg_name(t)} registers {regs}  local bytes {local}  dynamic shared bytes {t.shared_bytes(HEAD_DIM)}",
              flush=True)  # fmt: skip

    print("## time (us, median of CUDA events; TFLOP/s counts the causal (query, key) pairs)")
    for num_seqs, prompt, cached in CASES:
        label = f"{num_seqs}x{prompt}" + (f"_after{cached}" if cached else "")
        inp = make_inputs(rng, [(cached, prompt)] * num_seqs)
        flops = 4 * NUM_HEADS * HEAD_DIM * num_seqs * (prompt * cached + prompt * (prompt + 1) // 2)
        out = cuda.device_array(inp["q"].shape, np.float32)
        try:
            row = {"torch_flash": time_it(torch_flash(inp), args.reps, 10)}
        except Exception as e:  # an SDPA path this torch lacks: time ours anyway
            print(f"{label}: torch failed: {type(e).__name__}: {e}")
            row = {"torch_flash": float("nan")}
        for m, k, q in tilings:
            name = f"tc_{m}x{k}{'q' * q}" + ("*" if (m, k, q) == default else "")
            row[name] = time_it(launcher(prefill_attention_tc, inp, out, (m, k, q)), args.reps, 10)
        for t in wg_tilings:
            name = f"wg_{_wg_name(t)}" + ("*" if t in wg_defaults else "")
            row[name] = time_it(launcher(prefill_attention_wgmma, inp, out, t), args.reps, 10)
        if args.cuda_cores:
            long = prompt * (prompt + cached) > 2048 * 4096
            row["cuda_cores"] = time_it(launcher(prefill_attention, inp, out), 3 if long else args.reps, 1 if long else 5)
        report["time_us"][label] = row
        ratios = "  ".join(f"{n[3:]} {v / row['torch_flash']:.2f}" for n, v in row.items() if n[:3] in ("tc_", "wg_"))
        print(f"{label:<20} " + "  ".join(f"{n} {v:9.1f} ({flops / v / 1e6:5.0f} TF)" for n, v in row.items())
              + f"   / torch: {ratios}", flush=True)
        del inp, out
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
