"""A step's inputs: a scheduler's sequences -> the int32 arrays the kernels read. The one place that
turns pages and positions into kv indices and block tables, for eager and CUDA-graph steps alike.

A sequence's K/V is spread over pages in any order; its block table (``page_ids``) lists them in
token order, so token ``pos`` of the sequence sits at kv index
``page_ids[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE``. Block tables are padded on the right
with the null page (page 0, never handed out). Decode block tables always have the width a CUDA
graph would record (`table_width`: a power of two, at least `MIN_TABLE_WIDTH`), so that split
attention cuts the context at the same pages in eager and replayed steps: identical results.

The arrays are numpy (host); the runner packs and uploads them (`kernel_runner.py`), the graph
runner writes the same values into its pinned buffer (`cuda_graph.py`). Field names are
`model.llama.StepInputs`'.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from numba_vllm.engine.kv_cache import NULL_PAGE_ID
from numba_vllm.engine.scheduler import ScheduledSequence
from numba_vllm.model.config import PAGE_SIZE

MIN_TABLE_WIDTH = 8  # pages (128 tokens): the narrowest decode block table


def table_width(num_pages: int) -> int:
    """The decode block-table width (pages) of a step whose longest sequence has `num_pages` pages."""
    return max(MIN_TABLE_WIDTH, 1 << (num_pages - 1).bit_length())


def block_table_array(page_id_lists: Sequence[Sequence[int]], max_pages: int) -> np.ndarray:
    """Stack block tables into ``(B, max_pages)`` int32, padded on the right with the null page."""
    table = np.full((len(page_id_lists), max_pages), NULL_PAGE_ID, dtype=np.int32)  # (B, max_pages)
    for row, page_ids in enumerate(page_id_lists):
        if len(page_ids) > max_pages:
            raise ValueError(f"block table row {row} has {len(page_ids)} pages, more than max_pages={max_pages}")
        table[row, : len(page_ids)] = page_ids
    return table


def kv_index(page_ids: Sequence[int], position: int) -> int:
    """Where the token at `position` of one sequence keeps its K/V (one decode token)."""
    if not 0 <= position < len(page_ids) * PAGE_SIZE:
        raise ValueError(_beyond_table(position, position, len(page_ids)))
    return page_ids[position // PAGE_SIZE] * PAGE_SIZE + position % PAGE_SIZE


def kv_indices(page_ids: Sequence[int], positions: Sequence[int] | np.ndarray) -> np.ndarray:
    """Where the tokens at ``positions`` of one sequence keep their K/V: ``(T,)`` int32 kv indices.

    A position beyond the block table is an error, never a silent wrap.
    """
    if len(positions) == 1:  # a decode token: plain arithmetic (numpy's per-call cost would dominate)
        return np.array([kv_index(page_ids, int(positions[0]))], np.int32)
    positions = np.asarray(positions, dtype=np.int64)  # (T,)
    table = np.asarray(page_ids, dtype=np.int64)  # (num_pages_of_sequence,)
    page_numbers = positions // PAGE_SIZE  # (T,) which entry of the block table
    if positions.size and (positions.min() < 0 or page_numbers.max() >= len(table)):
        raise ValueError(_beyond_table(positions.min(), positions.max(), len(table)))
    return (table[page_numbers] * PAGE_SIZE + positions % PAGE_SIZE).astype(np.int32)


def _beyond_table(first: int, last: int, num_pages: int) -> str:
    return f"positions {first}..{last} need pages beyond the {num_pages} in the block table"


def positions(seq: ScheduledSequence) -> np.ndarray:
    """(num_new_tokens,) int32 positions of the sequence's new tokens."""
    return np.arange(seq.start_position, seq.context_len, dtype=np.int32)


def step_arrays(seqs: list[ScheduledSequence]) -> tuple[dict[str, np.ndarray], int, int]:
    """The int32 arrays of an eager step whose prefilling sequences come first, decoding ones last:
    (arrays by StepInputs field name, number of prefill tokens, the longest prefill chunk)."""
    prefill = [s for s in seqs if not s.is_decode]
    decode = [s for s in seqs if s.is_decode]
    ends = np.cumsum([s.num_new_tokens for s in seqs], dtype=np.int32)  # (S,) end of each sequence's tokens
    cu = np.zeros(len(prefill) + 1, np.int32)  # (Sp + 1,)
    cu[1:] = ends[: len(prefill)]
    width = max(len(s.page_ids) for s in seqs)
    arrays = {
        "token_ids": np.fromiter((t for s in seqs for t in s.token_ids), np.int32, int(ends[-1])),  # (T,)
        "positions": np.concatenate([positions(s) for s in seqs]),  # (T,)
        "kv_indices": np.concatenate([kv_indices(s.page_ids, positions(s)) for s in seqs]),  # (T,)
        "prefill_cu_seqlens": cu,
        "prefill_start_pos": np.array([s.start_position for s in prefill], np.int32),  # (Sp,)
        "prefill_block_tables": block_table_array([s.page_ids for s in prefill], width),  # (Sp, width)
        "decode_block_tables": block_table_array([s.page_ids for s in decode], table_width(width)),  # (Sd, W)
        "decode_context_lens": np.array([s.context_len for s in decode], np.int32),  # (Sd,)
        "sample_rows": np.array([end - 1 for s, end in zip(seqs, ends, strict=True) if s.samples], np.int32),  # (B,)
    }
    return arrays, int(cu[-1]), max((s.num_new_tokens for s in prefill), default=0)


def null_decode_step(num_tokens: int, num_sampled: int) -> dict[str, np.ndarray]:
    """`num_tokens` sequences decoding token 0 at position 0 into the null page, each attending to it;
    the first `num_sampled` are sampled (warm-up: compiles the decode-sized kernels)."""
    zeros = np.zeros(num_tokens, np.int32)
    return {
        "token_ids": zeros, "positions": zeros, "kv_indices": zeros,
        "prefill_cu_seqlens": np.zeros(1, np.int32), "prefill_start_pos": np.zeros(0, np.int32),
        "prefill_block_tables": np.zeros((0, 1), np.int32), "decode_block_tables": np.zeros((num_tokens, 1), np.int32),
        "decode_context_lens": np.ones(num_tokens, np.int32), "sample_rows": np.arange(num_sampled, dtype=np.int32),
    }  # fmt: skip


def null_prefill_step(num_tokens: int) -> dict[str, np.ndarray]:
    """One sequence prefilling `num_tokens` tokens at positions 0.. whose pages are all the null page
    (warm-up: compiles the prefill-sized kernels)."""
    return {
        "token_ids": np.zeros(num_tokens, np.int32), "positions": np.arange(num_tokens, dtype=np.int32),
        "kv_indices": np.zeros(num_tokens, np.int32), "prefill_cu_seqlens": np.array([0, num_tokens], np.int32),
        "prefill_start_pos": np.zeros(1, np.int32),
        "prefill_block_tables": np.zeros((1, -(-num_tokens // PAGE_SIZE)), np.int32),
        "decode_block_tables": np.zeros((0, 1), np.int32), "decode_context_lens": np.zeros(0, np.int32),
        "sample_rows": np.array([num_tokens - 1], np.int32),
    }  # fmt: skip
