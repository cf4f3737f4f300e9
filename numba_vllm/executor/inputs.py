"""A step's inputs: a scheduler's sequences -> one packed int32 buffer the kernels read. The one place
that turns pages and positions into kv indices and block tables, and that pads a step to the shapes
CUDA graphs are recorded for, for eager and graph steps alike.

A sequence's K/V is spread over pages in any order; its block table (``page_ids``) lists them in
token order, so token ``pos`` of the sequence sits at kv index
``page_ids[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE``. Block tables are padded on the right
with the null page (page 0, never handed out).

Padding. Every step, eager or replayed, runs at a bucketed shape (`StepLayout.pack`), so that
an eager step and a replayed one launch the same kernels on the same shapes and give identical
results (the GEMMs pick their tiling and K split from the token count, decode attention its
context split from the batch and the table width):
- a decode-only step of B sequences is padded to the next batch bucket (`batch_buckets`); a
  padding row decodes token 0 at position 0 into slot 0 of the null page and attends to that one slot;
- a step with prefill tokens is padded to the next token bucket (`token_buckets`); its padding rows
  also write slot 0 of the null page, but no attention kernel looks at them (their rows of the
  attention output are stale, and only ever feed their own rows, which nothing reads);
- the sampled rows are padded to the next batch bucket (padding rows read token row 0, greedily);
- decode block tables are `table_width` pages wide (a power of two, at least `MIN_TABLE_WIDTH`).

Layout. The packed buffer (`StepLayout`) puts each array at a fixed offset, sized for the largest
step, so a CUDA graph recorded for one shape finds that shape's arrays at the same addresses every
step; the block tables come last and only the used part of the buffer is uploaded.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from numba_vllm.engine.kv_cache import NULL_PAGE_ID, pages_for_tokens
from numba_vllm.engine.request import Request
from numba_vllm.engine.sampling import SamplingParams
from numba_vllm.engine.scheduler import ScheduledSequence
from numba_vllm.model.config import PAGE_SIZE
from numba_vllm.model.llama import StepInputs

MIN_TABLE_WIDTH = 8  # pages (128 tokens): the narrowest decode block table


def table_width(num_pages: int) -> int:
    """The decode block-table width (pages) of a step whose longest sequence has `num_pages` pages."""
    return max(MIN_TABLE_WIDTH, 1 << (num_pages - 1).bit_length())


def batch_buckets(limit: int) -> list[int]:
    """Sizes a batch is padded to: 1, 2, 4, 8, then steps of 8 up to 128, of 16 up to 256, of 32 up
    to 512 ... (an eighth of the power of two below), capped at and including `limit`. A batch is
    padded by less than an eighth of its size (past 8)."""
    sizes, n = [1, 2, 4], 8
    while n < limit:
        sizes.append(n)
        n += max(8, (1 << (n.bit_length() - 1)) // 8)
    return [s for s in sizes if s < limit] + [limit]


def token_buckets(max_num_seqs: int, max_step_tokens: int) -> list[int]:
    """Token counts a step with prefill tokens is padded to: the batch buckets up to `max_num_seqs`
    (so a step of B tokens has the shape of a decode step of B sequences), then the same progression
    up to `max_step_tokens`."""
    return batch_buckets(max_num_seqs) + [n for n in batch_buckets(max_step_tokens) if n > max_num_seqs]


def bucket(sizes: list[int], n: int) -> int:
    """The smallest of the sorted `sizes` that holds `n`."""
    i = bisect.bisect_left(sizes, n)
    if i == len(sizes):
        raise ValueError(f"{n} is beyond the largest bucket ({sizes[-1]})")
    return sizes[i]


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


@dataclass
class SamplingRows:
    """Per-row inputs of the device sampler (numpy, one entry per sampled sequence of the step)."""

    temperatures: np.ndarray  # (B,) float32, 0 = greedy
    seeds: np.ndarray  # (B,) uint32
    steps: np.ndarray  # (B,) int32: each request's output index


@dataclass
class SamplerInputs:
    """The device sampler's arrays of a step (views of the packed buffer, and the sampled tokens)."""

    temperatures: object  # (B,) float32 device view
    seeds: object  # (B,) uint32 device view
    steps: object  # (B,) int32 device view
    tokens: object  # (B,) int32 device array: where the sampler writes


@dataclass(frozen=True)
class StepShape:
    """What a step's device views depend on (all padded): equal shapes, equal views and graphs."""

    num_tokens: int  # T: rows of token_ids, positions, kv_indices
    num_prefill_tokens: int  # Tp: the first Tp rows belong to prefilling sequences
    prefill_max_new_tokens: int  # the longest prefill chunk (sizes the prefill attention grid)
    num_prefill_seqs: int  # Sp
    prefill_width: int  # pages per prefill block-table row (the longest prefilling sequence's)
    num_decode_rows: int  # rows Tp .. Tp + Sd - 1 the decode attention covers (decode-only: all T)
    decode_width: int  # W = table_width(longest decoding sequence)
    num_sampled: int  # sampled rows (a batch bucket, or 0)


@dataclass(frozen=True)
class PackedStep:
    """A step packed by `StepLayout.pack`: its shape and what the runner needs besides."""

    shape: StepShape
    num_sampled: int  # real sampled rows: the first of shape.num_sampled
    fed_rows: tuple[int, int]  # (first row, count): token rows filled on the device from the previous step
    num_words: int  # the packed buffer's used prefix (what to upload)


class StepLayout:
    """Where each int32 array of a step sits in the packed buffer, for steps of up to
    `max_num_tokens` tokens, `max_num_seqs` sequences and `max_pages` pages per sequence.

    Regions, in order (sizes are the maxima, so every offset is fixed): token ids, positions, kv
    indices (T each); sample rows, temperatures (float32 bits), seeds (uint32 bits), output indices,
    decode context lengths, fed-token sources (B each); prefill cu_seqlens (Sp + 1) and start
    positions (Sp); then the decode block tables (Sd, W) and right after them the prefill block
    tables (Sp, Wp).
    """

    def __init__(self, max_num_tokens: int, max_num_seqs: int, max_pages: int):
        self.max_num_tokens, self.max_num_seqs, self.max_pages = max_num_tokens, max_num_seqs, max_pages
        self.batch_sizes = batch_buckets(max_num_seqs)
        self.token_sizes = token_buckets(max_num_seqs, max_num_tokens)
        t, b = max_num_tokens, max_num_seqs
        self.tokens, self.positions, self.kv_indices = 0, t, 2 * t
        self.sample_rows, self.temperatures, self.seeds, self.steps = 3 * t, 3 * t + b, 3 * t + 2 * b, 3 * t + 3 * b
        self.context_lens, self.fed_sources = 3 * t + 4 * b, 3 * t + 5 * b
        self.cu_seqlens, self.start_pos = 3 * t + 6 * b, 3 * t + 7 * b + 1
        self.tables = 3 * t + 8 * b + 1
        self.num_words = self.tables + b * (table_width(max_pages) + max_pages)  # the buffer's size

    def pack(
        self, host: np.ndarray, seqs: list[ScheduledSequence], sampling: SamplingRows, fed_sources: Sequence[int] = ()
    ) -> PackedStep:
        """Write a step into `host` ((>= num_words,) int32) and return its shape.

        `seqs`: prefilling sequences first, then decoding ones; the last ``len(fed_sources)`` decoding
        ones have their token (None here) fed on the device from row ``fed_sources[i]`` of the previous
        step's sampled tokens. `sampling`: the sampler's inputs of the sampling sequences, in order.
        """
        num_prefill = next((i for i, s in enumerate(seqs) if s.is_decode), len(seqs))
        prefill, decode = seqs[:num_prefill], seqs[num_prefill:]
        if not all(s.is_decode for s in decode):
            raise ValueError("pack: prefilling sequences must come before decoding ones")
        tp = sum(s.num_new_tokens for s in prefill)
        if prefill:
            num_tokens, decode_rows = bucket(self.token_sizes, tp + len(decode)), len(decode)
        else:
            num_tokens = decode_rows = bucket(self.batch_sizes, len(decode))
        if len(seqs) > self.max_num_seqs:
            raise ValueError(f"pack: {len(seqs)} sequences, more than max_num_seqs={self.max_num_seqs}")
        width = table_width(max((len(s.page_ids) for s in decode), default=1))
        prefill_width = max((len(s.page_ids) for s in prefill), default=0)
        sampled = [row for row in self._last_rows(seqs) if row is not None]
        num_sampled = bucket(self.batch_sizes, len(sampled)) if sampled else 0
        h, t, b = host, num_tokens, num_sampled

        tokens, pos, kv = (h[o : o + t] for o in (self.tokens, self.positions, self.kv_indices))
        tokens[:] = pos[:] = kv[:] = 0  # padding rows: token 0 at position 0, in slot 0 of the null page
        row = 0
        for s in prefill:
            n, p = s.num_new_tokens, positions(s)
            if None in s.token_ids:
                raise ValueError(f"pack: request {s.request.request_id}'s prefill has a token not known on the host")
            tokens[row : row + n] = s.token_ids
            pos[row : row + n] = p
            kv[row : row + n] = kv_indices(s.page_ids, p)
            row += n
        first_fed = row + len(decode) - len(fed_sources)
        context = h[self.context_lens : self.context_lens + decode_rows]
        context[:] = 1  # a padding decode row attends to its one slot
        tables = h[self.tables : self.tables + decode_rows * width].reshape(decode_rows, width)
        tables[:] = NULL_PAGE_ID
        for i, s in enumerate(decode):
            token = s.token_ids[0]
            if (token is None) != (row >= first_fed):
                raise ValueError(f"pack: request {s.request.request_id}: its token must be fed exactly when it is unknown")
            tokens[row] = 0 if token is None else token
            pos[row] = s.start_position
            kv[row] = kv_index(s.page_ids, s.start_position)
            context[i] = s.context_len
            tables[i, : len(s.page_ids)] = s.page_ids
            row += 1
        h[self.fed_sources : self.fed_sources + len(fed_sources)] = fed_sources

        end = self.tables + decode_rows * width
        if prefill:
            cu = h[self.cu_seqlens : self.cu_seqlens + len(prefill) + 1]
            cu[0] = 0
            cu[1:] = np.cumsum([s.num_new_tokens for s in prefill])
            h[self.start_pos : self.start_pos + len(prefill)] = [s.start_position for s in prefill]
            h[end : end + len(prefill) * prefill_width] = block_table_array([s.page_ids for s in prefill], prefill_width).ravel()
            end += len(prefill) * prefill_width

        h[self.sample_rows : self.sample_rows + b] = 0  # padding rows sample token row 0, greedily
        h[self.sample_rows : self.sample_rows + len(sampled)] = sampled
        for offset, values in ((self.temperatures, sampling.temperatures.view(np.int32)),
                               (self.seeds, sampling.seeds.view(np.int32)), (self.steps, sampling.steps)):  # fmt: skip
            h[offset : offset + b] = 0
            h[offset : offset + len(values)] = values
        shape = StepShape(
            num_tokens=num_tokens, num_prefill_tokens=tp,
            prefill_max_new_tokens=max((s.num_new_tokens for s in prefill), default=0), num_prefill_seqs=len(prefill),
            prefill_width=prefill_width, num_decode_rows=decode_rows, decode_width=width, num_sampled=num_sampled,
        )  # fmt: skip
        return PackedStep(shape, len(sampled), (first_fed, len(fed_sources)), end)

    @staticmethod
    def _last_rows(seqs: list[ScheduledSequence]) -> list[int | None]:
        """Per sequence, the token row whose logits it samples from (None for a chunk that does not sample)."""
        ends = np.cumsum([s.num_new_tokens for s in seqs])
        return [int(end) - 1 if s.samples else None for s, end in zip(seqs, ends, strict=True)]

    def views(self, device, shape: StepShape, tokens) -> tuple[StepInputs, SamplerInputs]:
        """The model's and the sampler's inputs of a step of `shape`: views of `device`, the packed
        buffer on the device ((num_words,) int32); `tokens` ((>= B,) int32 device) takes the samples."""
        d, t, b, rows, w = device, shape.num_tokens, shape.num_sampled, shape.num_decode_rows, shape.decode_width
        sp, wp = shape.num_prefill_seqs, shape.prefill_width
        prefill_tables = self.tables + rows * w
        inputs = StepInputs(
            token_ids=d[self.tokens : self.tokens + t],
            positions=d[self.positions : self.positions + t],
            kv_indices=d[self.kv_indices : self.kv_indices + t],
            num_prefill_tokens=shape.num_prefill_tokens,
            prefill_cu_seqlens=d[self.cu_seqlens : self.cu_seqlens + sp + 1] if sp else None,
            prefill_start_pos=d[self.start_pos : self.start_pos + sp] if sp else None,
            prefill_block_tables=d[prefill_tables : prefill_tables + sp * wp].reshape(sp, wp) if sp else None,
            prefill_max_new_tokens=shape.prefill_max_new_tokens,
            decode_block_tables=d[self.tables : self.tables + rows * w].reshape(rows, w),
            decode_context_lens=d[self.context_lens : self.context_lens + rows],
            sample_rows=d[self.sample_rows : self.sample_rows + b],
        )
        sampler = SamplerInputs(
            temperatures=d[self.temperatures : self.temperatures + b].view(np.float32),
            seeds=d[self.seeds : self.seeds + b].view(np.uint32),
            steps=d[self.steps : self.steps + b],
            tokens=tokens[:b],
        )
        return inputs, sampler

    def fed_views(self, device, packed: PackedStep):
        """(sources (n,), destination rows (n, 1)) int32 device views: the fed tokens' rows of the previous
        step's samples, and the token-id rows they go to."""
        first, n = packed.fed_rows
        sources = device[self.fed_sources : self.fed_sources + n]
        return sources, device[self.tokens + first : self.tokens + first + n].reshape(n, 1)


def null_sequences(num_prefill_tokens: int, num_decodes: int, decode_pages: int = 1) -> list[ScheduledSequence]:
    """A warm-up step that reads and writes only the null page: one greedy sequence prefilling
    `num_prefill_tokens` tokens (none if 0), then `num_decodes` greedy sequences decoding one token
    each over a `decode_pages`-page block table (all the null page)."""
    greedy = SamplingParams(temperature=0)
    seqs = []
    if num_prefill_tokens:
        request = Request("warm-up", [0] * num_prefill_tokens, greedy, -1)
        null_table = [NULL_PAGE_ID] * pages_for_tokens(num_prefill_tokens)
        seqs.append(ScheduledSequence(request, 0, 0, request.prompt_token_ids, null_table, True))
    for i in range(num_decodes):
        request = Request(f"warm-up-{i}", [0], greedy, -1, output_token_ids=[0])
        seqs.append(ScheduledSequence(request, i, 1, [0], [NULL_PAGE_ID] * decode_pages, True))
    return seqs
