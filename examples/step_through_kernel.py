"""Stop inside a kernel at one CUDA thread with pdb, under the Numba CUDA simulator.

    python examples/step_through_kernel.py --kernel rmsnorm                    # pdb at thread 0 of block 0
    python examples/step_through_kernel.py --kernel rmsnorm --block 1 --thread 37
    python examples/step_through_kernel.py --kernel decode_attention --block 1,0 --thread 9
    python examples/step_through_kernel.py --kernel model                      # one token: the fused RMSNorm, attention
    python examples/step_through_kernel.py --kernel rmsnorm --no-pdb           # print what the thread sees

``rmsnorm`` runs ``rms_norm`` on 2 rows of 300 columns (grid 2, blocks of 96 threads = 3 warps).
``decode_attention`` runs paged decode attention for 2 sequences of 40 and 21 cached tokens, 2 kv heads
of 2 query heads each, head dim 64 (grid (kv head, sequence) = (2, 2), blocks of 8 warps).
``model`` builds a tiny random Llama (2 layers, hidden 64, 4 heads, 2 kv heads, head dim 16), prefills a
1-token prompt on the ``sim`` backend, then follows the next token through the decode step's forward:
it stops in the first RMSNorm, which decode runs fused into the q/k/v product (``gemv_t1_norm_kernel``:
each lane sums the squares of the x values it loads, then the sums are reduced with the dot
products; block 0 holds the first rows), and then in layer 0's paged decode attention (``--block``
is (kv head, sequence 0)).

With ``--no-pdb`` the stops print the thread's variables next to the same numbers computed with NumPy.
The guide is docs/stepping_through_kernels.md.
"""

import os

os.environ["NUMBA_ENABLE_CUDASIM"] = "1"  # before numba is imported: each CUDA thread becomes a Python thread

import argparse  # noqa: E402
import bdb  # noqa: E402
import contextlib  # noqa: E402
import math  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402

from numba_vllm.engine.config import EngineConfig  # noqa: E402
from numba_vllm.engine.llm_engine import LLMEngine  # noqa: E402
from numba_vllm.engine.sampling import SamplingParams  # noqa: E402
from numba_vllm.kernels import reductions  # noqa: E402
from numba_vllm.kernels._launch import KernelError  # noqa: E402
from numba_vllm.kernels.decode_attention import decode_attention, decode_attention_kernel_for  # noqa: E402
from numba_vllm.kernels.gemv import gemv_kernel_for  # noqa: E402
from numba_vllm.kernels.rmsnorm import rms_norm, rms_norm_kernel  # noqa: E402
from numba_vllm.loading.bf16 import to_bf16, upload_bf16  # noqa: E402
from numba_vllm.loading.checkpoint import Checkpoint  # noqa: E402
from numba_vllm.model.config import PAGE_SIZE, ModelConfig  # noqa: E402
from numba_vllm.sim.stepping import break_in  # noqa: E402

EPS = 1e-5

# Where the script stops (text of the line: line numbers move when a kernel is edited).
RMS_BEFORE_REDUCTION = "total = block_sum(sum_sq, scratch)"
RMS_AFTER_REDUCTION = "inv_rms = float32(1.0)"
WARP_SUM_ROUND = "offset //= 2"  # in reductions.warp_sum, after x += shfl_xor_sync(...)
BLOCK_SUM_AFTER_BARRIER = "partial = scratch[lane]"  # in reductions.block_sum
ATTN_LANE_MAPPING = "context_len = context_lens[b]"
ATTN_BEFORE_SHUFFLE = "offset = 1"
ATTN_SHUFFLE_ROUND = "offset *= 2"
ATTN_END_OF_STEP = "si += num_warps"
ATTN_MERGE = "o = cuda.threadIdx.x"  # after the syncthreads: shared memory holds every lane's partial
ATTN_OUTPUT = "o += threads"  # after this thread wrote its first output element
GEMV_NORM_SUM_SQ = "total, t, writer = sum_squares(sum_sq, lane)"  # the lane's sums of x^2 over its chunks, before the reduction
GEMV_NORM_SCALE = "total *= scale"  # a storing thread: the row's sum of x^2 and the norm's scale

COMMANDS = """\
pdb commands (this thread only; the other threads of the block wait for it at their next barrier/shuffle):
  p cuda.threadIdx.x, cuda.blockIdx.x   which thread am I?       pp locals()   every local variable
  n        run this line (over a shuffle or syncthreads: it returns once the other threads arrive)
  s        step into a device function (block_sum, warp_sum)     r   run to the function's return
  ll       list the whole function       w / u / d   the call stack, up, down
  c        continue to the next stop (or the end of the launch)  q   abort the launch"""

CHEAT_RMSNORM = COMMANDS + """
try here:
  p sum_sq, xs            this thread's sum of squares over its own columns, and its x values (registers)
  p x[t, :8].copy_to_host()                 a kernel argument (global memory)
  n                       then: p total     (the whole row's sum: block_sum ran in every thread)
  p scratch[:cuda.blockDim.x // 32]         shared memory: one partial sum per warp
  or: s (into block_sum), n down to `x = warp_sum(x)`, s (into warp_sum), then n, n, p offset, x:
      after each shfl_xor_sync round x is the sum over twice as many lanes"""

CHEAT_GEMV_NORM = COMMANDS + """
try here (the RMSNorm fused into the q/k/v product: gemv_t1_norm_kernel):
  p lane, warp, part, warps_per_group    which K chunks this lane read: chunk part * 32 + lane, then every 32 * warps_per_group
  p sum_sq[0]                            this lane's sum of x^2 over its chunks (the one token)
  p acc[:, 0]                            its partial dot products with the 4 weight rows of its group
  p dots                                 the same, after the warp summed them (warp_sums: this lane holds one)
  n  p total                             after sum_squares (warp_sums): the warp's sum of x^2
  c                                      to the storing thread: p sq, scale (the row's sum of x^2, 1/rms)"""

CHEAT_ATTN_SHUFFLE = COMMANDS + """
try here (the first score of this lane's first step):
  p kv_head, b, warp, lane, token_slot, d0   the block's (kv head, sequence), the lane's token and 8 dims
  p page, pos, block_tables[b, :4].copy_to_host()   the page this step reads, via the block table
  p s                     q . K over this lane's 8 dims only
  n  n  n  p s            after one shfl_xor_sync round: the sum of 2 lanes' parts (n n n p s again: 4 lanes, ...)
  p scores[:loads * group]       this step's scores so far (loads x group)
  p m[:group], sum_exp[:group]   the online softmax's running max and sum (-inf, 0 before the first step)"""

CHEAT_ATTN_MERGE = COMMANDS + """
try here (after the syncthreads: shared memory holds every lane's partial softmax):
  p part, m[:group], sum_exp[:group]     this lane's slot in part_* and what it wrote there
  p part_m[:, 0], part_sum[:, 0]         every partial of query head 0 (-inf: saw no token)
  p part_acc[part, 0, d0:d0 + 8]         this lane's sum of exp(score - m) * V for its 8 dims
  n  (repeat)  p g, d, m_all, total, total_sum   this thread merges output (head g, dim d)"""


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", choices=("rmsnorm", "decode_attention", "model"), default="rmsnorm")
    parser.add_argument("--block", type=_index, default=(0,), help="blockIdx: x or x,y (default 0)")
    parser.add_argument("--thread", type=_index, default=(0,), help="threadIdx: x (default 0)")
    parser.add_argument("--no-pdb", action="store_true", help="print the thread's variables instead of stopping")
    args = parser.parse_args()
    run = {"rmsnorm": run_rmsnorm, "decode_attention": run_decode_attention, "model": run_model}[args.kernel]
    try:
        run(args.block, args.thread, args.no_pdb)
    except KernelError as e:
        if not isinstance(e.__cause__, bdb.BdbQuit):
            raise
        print("quit from pdb: the launch was aborted")


def _index(text):
    return tuple(int(v) for v in text.split(","))


# ---- rmsnorm -------------------------------------------------------------------------------------


def run_rmsnorm(block, thread, no_pdb):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 300)).astype(np.float32)  # (T, D): grid T = 2 blocks, 96 threads = 3 warps
    weight = to_bf16(1.0 + 0.1 * rng.standard_normal(300))  # (D,) bf16
    out = cuda.to_device(np.full(x.shape, np.nan, np.float32))
    print(f"rms_norm: x {x.shape}, grid {x.shape[0]} blocks (one per row) of 96 threads; stopping block {block} thread {thread}")
    with rmsnorm_stops(block, thread, no_pdb) as stops:
        rms_norm(cuda.to_device(x), upload_bf16(weight), out, EPS)
    report_unreached(stops)
    want = x / np.sqrt((x.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + EPS) * weight.astype(np.float64)
    print(f"output matches NumPy: {np.allclose(out.copy_to_host(), want, rtol=1e-5, atol=1e-6)}")


@contextlib.contextmanager
def rmsnorm_stops(block, thread, no_pdb, max_hits=None):
    """Arm the RMSNorm stops: pdb before the block reduction, or printing callbacks around it."""
    with contextlib.ExitStack() as stack:
        if not no_pdb:
            stops = [stack.enter_context(
                break_in(rms_norm_kernel, RMS_BEFORE_REDUCTION, block=block, thread=thread, max_hits=max_hits,
                         intro=CHEAT_RMSNORM))]  # fmt: skip
        else:
            printer = RmsPrinter()
            stops = [
                stack.enter_context(break_in(fn, line, block=block, thread=thread, on_hit=on_hit, max_hits=hits))
                for fn, line, on_hit, hits in (
                    (rms_norm_kernel, RMS_BEFORE_REDUCTION, printer.before_reduction, max_hits),
                    (reductions.warp_sum, WARP_SUM_ROUND, printer.warp_sum_round, None if max_hits is None else 10),
                    (reductions.block_sum, BLOCK_SUM_AFTER_BARRIER, printer.after_barrier, max_hits),
                    (rms_norm_kernel, RMS_AFTER_REDUCTION, printer.after_reduction, max_hits),
                )
            ]
        yield stops


class RmsPrinter:
    """What one thread of rms_norm_kernel sees, next to NumPy. Values come from the frame's locals."""

    def before_reduction(self, frame):
        f = frame.f_locals
        row = f["x"][f["t"]].copy_to_host()  # (D,) the block's row, read through the kernel's argument
        self.threads = _cuda(frame).blockDim.x
        tid = _cuda(frame).threadIdx.x
        # every thread's partial sum of squares, in the kernel's order (float32, column by column)
        self.partials = np.zeros(self.threads, np.float32)
        for j, v in enumerate(row):
            self.partials[j % self.threads] += v * v  # one tile: thread j % threads owns column j
        self.row = row
        self.round = 0
        cols = list(range(tid, len(row), self.threads))
        print(f"\n[{frame.f_code.co_name} line {frame.f_lineno}] thread {tid} of block {f['t']}: "
              f"{RMS_BEFORE_REDUCTION}")  # fmt: skip
        print(f"  columns {cols}: xs = {np.array(f['xs'][: len(cols)])}")
        print(f"  sum_sq = {f['sum_sq']:.8g}   NumPy, the same float32 additions: {self.partials[tid]:.8g}")

    def warp_sum_round(self, frame):
        f = frame.f_locals
        offset, x = f["offset"], f["x"]
        lane, warp = _cuda(frame).threadIdx.x % 32, _cuda(frame).threadIdx.x // 32
        self.round += 1
        if self.round == 1:
            print(f"  [warp_sum, 1st call: this warp's 32 partials] lane {lane} of warp {warp}, {WARP_SUM_ROUND!r}:")
        elif self.round == 6:
            print("  [warp_sum, 2nd call: the warps' sums read back from scratch]")
        values = self.partials[32 * warp : 32 * warp + 32] if self.round <= 5 else self.warp_sums_padded()
        lanes = [k for k in range(32) if k % offset == lane % offset]  # the lanes folded in so far
        want = np.float64(values[lanes].astype(np.float64).sum())
        print(f"    round shfl_xor_sync(.., x, {offset:2}): x = {x:<11.8g} = the sum over {len(lanes):2} lanes, "
              f"NumPy {want:.8g}")  # fmt: skip

    def warp_sums_padded(self):
        sums = np.zeros(32, np.float32)
        num_warps = self.threads // 32
        sums[:num_warps] = self.partials.reshape(num_warps, 32).astype(np.float64).sum(axis=1)
        return sums

    def after_barrier(self, frame):
        f = frame.f_locals
        num_warps = f["num_warps"]
        print(f"  [block_sum line {frame.f_lineno}] after the first syncthreads, shared memory:")
        print(f"    scratch[:{num_warps}] = {f['scratch'][:num_warps]}   NumPy per-warp sums: "
              f"{self.warp_sums_padded()[:num_warps]}")  # fmt: skip

    def after_reduction(self, frame):
        f = frame.f_locals
        want = (self.row.astype(np.float64) ** 2).sum()
        print(f"  [{frame.f_code.co_name} line {frame.f_lineno}] back in the kernel: total = {f['total']:.8g}   "
              f"NumPy sum of the row's squares: {want:.8g}")  # fmt: skip


# ---- decode attention ----------------------------------------------------------------------------


def run_decode_attention(block, thread, no_pdb):
    rng = np.random.default_rng(0)
    seq_lens, num_kv_heads, group, head_dim = [40, 21], 2, 2, 64
    pages = [-(-n // PAGE_SIZE) for n in seq_lens]
    num_pages = 1 + sum(pages) + 2  # page 0 is the null page
    page_ids = rng.permutation(np.arange(1, num_pages)).astype(np.int32)  # pages in no particular order
    block_tables = np.zeros((len(seq_lens), max(pages)), np.int32)
    k_pool = np.zeros((num_pages, PAGE_SIZE, num_kv_heads, head_dim), np.float32)
    v_pool = np.zeros_like(k_pool)
    used = 0
    for s, n in enumerate(seq_lens):
        block_tables[s, : pages[s]] = page_ids[used : used + pages[s]]
        used += pages[s]
        pos = np.arange(n)
        for pool in (k_pool, v_pool):  # values the bf16 cache holds exactly
            pool[block_tables[s, pos // PAGE_SIZE], pos % PAGE_SIZE] = to_bf16(rng.standard_normal((n, num_kv_heads, head_dim)))
    q = rng.standard_normal((len(seq_lens), group * num_kv_heads, head_dim)).astype(np.float32)
    out = cuda.to_device(np.full(q.shape, np.nan, np.float32))
    print(f"decode_attention: {len(seq_lens)} sequences of {seq_lens} tokens, {num_kv_heads} kv heads x {group} query heads,"
          f" head dim {head_dim}; block tables {block_tables.tolist()}")  # fmt: skip
    print(f"grid (kv head, sequence) = ({num_kv_heads}, {len(seq_lens)}); stopping block {block} thread {thread}")
    with attention_stops(block, thread, no_pdb) as stops:
        decode_attention(cuda.to_device(q), upload_bf16(k_pool), upload_bf16(v_pool), cuda.to_device(block_tables),
                         cuda.to_device(np.array(seq_lens, np.int32)), 1 / math.sqrt(head_dim), out)  # fmt: skip
    report_unreached(stops)
    got = out.copy_to_host()
    ok = all(
        np.allclose(got[s, h], attention_reference(q[s, h], k_pool, v_pool, block_tables[s], n, h // group, head_dim ** -0.5),
                    rtol=1e-4, atol=1e-5)
        for s, n in enumerate(seq_lens) for h in range(q.shape[1])
    )  # fmt: skip
    print(f"output matches NumPy: {ok}")


def attention_reference(q, k_pool, v_pool, table, n, kv_head, scale):
    """softmax(scale * q . K) V for one query head over the sequence's n cached tokens (float64)."""
    pos = np.arange(n)
    k = k_pool[table[pos // PAGE_SIZE], pos % PAGE_SIZE, kv_head].astype(np.float64)  # (n, HD)
    v = v_pool[table[pos // PAGE_SIZE], pos % PAGE_SIZE, kv_head].astype(np.float64)
    scores = k @ q.astype(np.float64) * scale
    p = np.exp(scores - scores.max())
    return p @ v / p.sum()


@contextlib.contextmanager
def attention_stops(block, thread, no_pdb):
    """Arm the decode attention stops: pdb before the first score's shuffle and at the merge, or
    printing callbacks along the way."""
    kernel = decode_attention_kernel_for(1, 8)  # any configuration: they all share one code object
    with contextlib.ExitStack() as stack:
        if not no_pdb:
            stops = [
                stack.enter_context(break_in(kernel, line, block=block, thread=thread, max_hits=1, intro=intro))
                for line, intro in ((ATTN_BEFORE_SHUFFLE, CHEAT_ATTN_SHUFFLE), (ATTN_MERGE, CHEAT_ATTN_MERGE))
            ]
        else:
            printer = AttentionPrinter()
            stops = [
                stack.enter_context(break_in(kernel, line, block=block, thread=thread, on_hit=on_hit, max_hits=hits))
                for line, on_hit, hits in (
                    (ATTN_LANE_MAPPING, printer.lane_mapping, 1),
                    (ATTN_BEFORE_SHUFFLE, printer.before_shuffle, 1),
                    (ATTN_SHUFFLE_ROUND, printer.shuffle_round, None),
                    (ATTN_END_OF_STEP, printer.end_of_step, None),
                    (ATTN_MERGE, printer.merge, 1),
                    (ATTN_OUTPUT, printer.output, 1),
                )
            ]
        yield stops


class AttentionPrinter:
    """What one thread of decode_attention_kernel sees, next to NumPy. Everything, the sizes included
    (``group``, ``step``, ...: the kernel's closure variables), comes from the frame's locals."""

    def lane_mapping(self, frame):
        f = frame.f_locals
        b, kv_head = f["b"], f["kv_head"]
        self.table = f["block_tables"][b].copy_to_host()
        self.n = int(f["context_lens"][b])
        self.k = _bf16_bits_to_f32(f["k_cache"].copy_to_host())  # (P, PAGE_SIZE, KVH, HD)
        self.v = _bf16_bits_to_f32(f["v_cache"].copy_to_host())
        group, head_dim = f["group"], f["head_dim"]
        self.q = f["q"][b].copy_to_host()[kv_head * group : (kv_head + 1) * group]  # (group, HD)
        self.scale = float(f["scale"])
        self.shuffle_rounds = 0
        self.merged = False
        print(f"\n[decode_attention_kernel line {frame.f_lineno}] block (kv head {kv_head}, sequence {b}), "
              f"{_cuda(frame).blockDim.x // 32} warps; thread {_cuda(frame).threadIdx.x} = warp {f['warp']} lane {f['lane']}")
        print(f"  group {group} query heads, head dim {head_dim}: {f['lanes_per_token']} lanes per token, "
              f"{f['tokens_per_load']} tokens per warp load, steps of {f['step']} tokens ({f['loads']} loads a lane)")
        print(f"  this lane reads token slot {f['token_slot']} of each load, dims {f['d0']}..{f['d0'] + 7}; "
              f"context {self.n} tokens, pages {self.table[: -(-self.n // PAGE_SIZE)].tolist()}")  # fmt: skip

    def _scores(self, f, pos):
        """scale * q . K[pos] for the block's kv head and its group's query heads, float64:
        (group,) for one position, (n, group) for an array of them."""
        k = self.k[self.table[pos // PAGE_SIZE], pos % PAGE_SIZE, f["kv_head"]]  # (HD,) or (n, HD)
        return k.astype(np.float64) @ self.q.astype(np.float64).T * self.scale

    def before_shuffle(self, frame):
        f = frame.f_locals
        i, g, pos = f["i"], f["g"], f["pos"]
        print(f"  step {f['si']}: page = block_tables[b, {f['si'] * f['step'] // PAGE_SIZE}] = {f['page']}; "
              f"load {i}, head {g}: token pos {pos}")  # fmt: skip
        print(f"    before the shuffles ({ATTN_BEFORE_SHUFFLE!r}): s = {f['s']:.8g}  "
              f"(q . K over dims {f['d0']}..{f['d0'] + 7} only)")  # fmt: skip

    def shuffle_round(self, frame):
        f = frame.f_locals
        self.shuffle_rounds += 1
        if self.shuffle_rounds > int(math.log2(f["lanes_per_token"])):
            return  # only the first score's rounds
        lanes = 2 * f["offset"]  # this line has not run yet: offset is the round's, 1, 2, 4, ...
        line = f"    after shfl_xor_sync(.., s, {f['offset']}): s = {f['s']:.8g}  (the sum over {lanes} lanes"
        if lanes == f["lanes_per_token"]:
            line += f": the full score; NumPy {self._scores(f, f['pos'])[f['g']]:.8g})"
        else:
            line += ")"
        print(line)

    def end_of_step(self, frame):
        if self.merged:
            return  # a later launch (the model's next layer): this printer follows the first one
        f = frame.f_locals
        group, loads, tpl = f["group"], f["loads"], f["tokens_per_load"]
        positions = [f["first"] + i * tpl + f["token_slot"] for i in range(loads)]
        scores = np.array(f["scores"][: loads * group]).reshape(loads, group)
        print(f"  end of step {f['si']} (page {f['page']}): this lane's tokens {positions}")
        for g in range(group):
            want = [self._scores(f, p)[g] if p < self.n else -np.inf for p in positions]
            print(f"    head {g}: scores {np.array2string(scores[:, g], precision=4)}  NumPy "
                  f"{np.array2string(np.array(want), precision=4)};  running m = {f['m'][g]:.5g}, "
                  f"sum_exp = {f['sum_exp'][g]:.5g}")  # fmt: skip

    def merge(self, frame):
        self.merged = True
        f = frame.f_locals
        step, num_warps, tpl = f["step"], _cuda(frame).blockDim.x // 32, f["tokens_per_load"]
        print(f"  [line {frame.f_lineno}] after the syncthreads: shared memory part_m, part_sum (head 0), "
              f"one partial per (warp, token slot), part = warp * {tpl} + token_slot:")
        for part in range(f["part_m"].shape[0]):
            warp, slot = divmod(part, tpl)
            tokens = [p for p in range(slot, self.n, tpl) if (p // step) % num_warps == warp]
            if not tokens:
                continue  # this (warp, slot) saw no token: part_m is -inf
            s = self._scores(f, np.array(tokens))[:, 0]
            m = s.max()
            print(f"    part {part:2} (warp {warp}, slot {slot}) tokens {tokens}: part_m {f['part_m'][part, 0]:.5g} "
                  f"part_sum {f['part_sum'][part, 0]:.5g}   NumPy {m:.5g} {np.exp(s - m).sum():.5g}")  # fmt: skip

    def output(self, frame):
        f = frame.f_locals
        g, d = f["g"], f["d"]
        h = f["kv_head"] * f["group"] + g
        want = attention_reference(self.q[g], self.k, self.v, self.table, self.n, f["kv_head"], self.scale)[d]
        print(f"  this thread merged out[{f['b']}, {h}, {d}] = total / total_sum = {f['total'] / f['total_sum']:.8g}   "
              f"NumPy {want:.8g}")  # fmt: skip


# ---- the RMSNorm fused into gemv -----------------------------------------------------------------


@contextlib.contextmanager
def gemv_norm_stops(block, thread, no_pdb):
    """Arm the stops of the RMSNorm fused into gemv (first launch only): pdb before the lane's sum of
    x^2 is reduced and where a storing thread applies the norm's scale, or printing callbacks there."""
    kernel = gemv_kernel_for(1, normalize=True)  # every variant shares one code object
    with contextlib.ExitStack() as stack:
        if not no_pdb:
            stops = [
                stack.enter_context(break_in(kernel, line, block=block, thread=thread, max_hits=1, intro=CHEAT_GEMV_NORM))
                for line in (GEMV_NORM_SUM_SQ, GEMV_NORM_SCALE)
            ]
        else:
            printer = GemvNormPrinter()
            stops = [
                stack.enter_context(break_in(kernel, line, block=block, thread=thread, on_hit=on_hit, max_hits=1))
                for line, on_hit in ((GEMV_NORM_SUM_SQ, printer.sum_sq), (GEMV_NORM_SCALE, printer.scale))
            ]
        yield stops


class GemvNormPrinter:
    """What one thread of gemv_t1_norm_kernel sees of the fused RMSNorm, next to NumPy."""

    def sum_sq(self, frame):
        f = frame.f_locals
        token = min(f["token0"], f["num_tokens"] - 1)  # (gemv_t1: one token a block)
        row = f["x"][token].copy_to_host()  # (K,) the token's activations, read through the kernel's argument
        chunks = list(range(f["part"] * 32 + f["lane"], f["k_dim"] // 8, 32 * f["warps_per_group"]))
        mine = np.concatenate([row[c * 8 : c * 8 + 8] for c in chunks]) if chunks else np.zeros(0, np.float32)
        print(f"\n[gemv_t1_norm_kernel line {frame.f_lineno}] thread {_cuda(frame).threadIdx.x} = warp {f['warp']} "
              f"lane {f['lane']}, token {token}: {GEMV_NORM_SUM_SQ}")  # fmt: skip
        print(f"  K = {f['k_dim']}: this lane read chunks {chunks} (8 x values each) and weighted them by the norm weight")
        print(f"  sum_sq[0] = {f['sum_sq'][0]:.8g}   NumPy sum of the squares of those x: "
              f"{(mine.astype(np.float64) ** 2).sum():.8g}")  # fmt: skip

    def scale(self, frame):
        f = frame.f_locals
        token = f["token0"] + f["t"]
        row = f["x"][token].copy_to_host().astype(np.float64)
        want_sq = (row**2).sum()
        print(f"  [line {frame.f_lineno}] thread {_cuda(frame).threadIdx.x} stores a dot product: the group's warps "
              f"reduced, sq = {f['sq']:.8g}   NumPy sum of the row's squares: {want_sq:.8g}")  # fmt: skip
        inv_rms = 1 / np.sqrt(want_sq / len(row) + float(f["eps"]))
        print(f"    scale = 1/sqrt(sq / K + eps) = {f['scale']:.8g}   NumPy 1/rms: {inv_rms:.8g}; "
              "the stored value is the dot product times it")  # fmt: skip


def _cuda(frame):
    """The simulator's fake ``cuda`` module that the kernel sees during the launch: its ``threadIdx``,
    ``blockIdx`` and ``blockDim`` answer for the calling (simulated) thread."""
    return frame.f_globals["cuda"]


def _bf16_bits_to_f32(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


# ---- one token through the model -----------------------------------------------------------------


TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "vocab_size": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def tiny_random_llama(seed=0):
    """A Checkpoint with random weights: matrices ~ N(0, 1/in), norm weights ~ 1 + N(0, 0.1)."""
    config = ModelConfig.from_dict(TINY_LLAMA)
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in config.tensor_shapes().items():
        w = 1.0 + 0.1 * rng.standard_normal(shape) if len(shape) == 1 else rng.standard_normal(shape) / np.sqrt(shape[1])
        weights[name] = w.astype(np.float32)
    return Checkpoint(config, weights, None, Path("<tiny random llama>"))


def run_model(block, thread, no_pdb):
    # Serial steps (no overlapped scheduling): each step() runs its forward pass and returns its token.
    # The readable decode attention kernel (the engine's default is the tensor-core one), the one this guide follows.
    config = EngineConfig(backend="sim", max_num_seqs=1, num_pages=8, max_model_len=64, async_scheduling=False,
                          decode_attention="reference")
    engine = LLMEngine(tiny_random_llama(), config)
    prompt = [1]  # one token: the simulator runs the prefill's matrix products slowly
    output = engine.add_request("0", prompt, SamplingParams(temperature=0, max_tokens=2))
    engine.step()  # prefill: the prompt through every layer (prefill attention); no stops armed
    token = output.outputs[0].token_ids[-1]
    print(f"tiny random Llama on the sim backend: prompt {prompt} prefilled, it predicted token {token}.")
    print(f"Now the decode step: token {token} at position {len(prompt)} goes through embedding -> RMSNorm fused "
          f"into the q/k/v product (gemv) -> RoPE -> cache write -> decode attention -> ...; stopping thread {thread}: "
          f"block 0 of the gemv (its first rows), block {block} of decode attention (kv head, sequence)")  # fmt: skip
    with contextlib.ExitStack() as stack:
        stops = stack.enter_context(gemv_norm_stops((0,), thread, no_pdb))
        stops += stack.enter_context(attention_stops(block, thread, no_pdb))
        engine.step()  # the decode step's forward pass; each stop fires once (layer 0)
    report_unreached(stops)
    print(f"the decode step predicted token {output.outputs[0].token_ids[-1]}")


def report_unreached(stops):
    for bp in stops:
        if not bp.hits:
            print(f"(never reached {bp.where()} at block {bp.block} thread {bp.thread}: no such block or thread, "
                  "or this thread skips that line)")  # fmt: skip


if __name__ == "__main__":
    main()
