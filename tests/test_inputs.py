"""A step's inputs from the scheduler's sequences: block tables, kv indices, positions, padding, the
packed layout (exact, CPU; the views in the simulator)."""

import numpy as np
import pytest
from numba import cuda

from numba_vllm.engine.request import Request
from numba_vllm.engine.sampling import SamplingParams
from numba_vllm.engine.scheduler import ScheduledSequence
from numba_vllm.executor.inputs import (
    MIN_TABLE_WIDTH,
    SamplingRows,
    StepLayout,
    StepShape,
    block_table_array,
    bucket,
    kv_index,
    kv_indices,
    null_sequences,
    table_width,
    token_buckets,
)


def test_block_table_array_pads_with_the_null_page():
    table = block_table_array([[3, 1], [7], [], [4, 5, 6]], max_pages=3)
    assert table.dtype == np.int32 and table.shape == (4, 3)
    assert table.tolist() == [[3, 1, 0], [7, 0, 0], [0, 0, 0], [4, 5, 6]]
    assert block_table_array([], 5).shape == (0, 5)
    with pytest.raises(ValueError, match="max_pages=2"):
        block_table_array([[1, 2, 3]], max_pages=2)


def test_kv_indices_across_page_edges():
    page_ids = [5, 2, 9]  # positions 0-15 in page 5, 16-31 in page 2, 32-47 in page 9
    positions = [0, 1, 15, 16, 17, 31, 32, 33, 47]
    indices = kv_indices(page_ids, positions)
    assert indices.dtype == np.int32
    assert indices.tolist() == [80, 81, 95, 32, 33, 47, 144, 145, 159]
    assert kv_indices(page_ids, np.arange(15, 18)).tolist() == [5 * 16 + 15, 2 * 16 + 0, 2 * 16 + 1]
    assert kv_indices(page_ids, []).tolist() == []
    assert [kv_indices(page_ids, range(p, p + 1)).tolist() for p in positions] == [[i] for i in indices]  # decode's path
    assert [kv_index(page_ids, p) for p in positions] == indices.tolist()
    for bad in (48, -1):  # 48 needs a 4th page
        with pytest.raises(ValueError):
            kv_indices(page_ids, [bad])
        with pytest.raises(ValueError):
            kv_index(page_ids, bad)


@pytest.mark.parametrize("pages,want", [(1, MIN_TABLE_WIDTH), (8, 8), (9, 16), (16, 16), (17, 32), (100, 128)])
def test_table_width(pages, want):
    assert table_width(pages) == want


def _seq(request_id, prompt_len, start, num_new, page_ids, samples=True, slot=0):
    request = Request(request_id, list(range(100, 100 + prompt_len)), SamplingParams(), 0)
    tokens = request.token_ids_between(start, start + num_new)
    return ScheduledSequence(request, slot=slot, start_position=start, token_ids=tokens, page_ids=page_ids, samples=samples)


def _decode(request_id, prompt_len, page_ids, token, slot=0):
    """A sequence decoding its first generated token (`token`; None: not on the host yet)."""
    request = Request(request_id, list(range(100, 100 + prompt_len)), SamplingParams(), 0, output_token_ids=[token])
    return ScheduledSequence(request, slot, prompt_len, [token], page_ids, True)


def _sampling(n):
    return SamplingRows(np.arange(n, dtype=np.float32) / 2, np.arange(n, dtype=np.uint32) + 7, np.arange(n, dtype=np.int32) + 3)


LAYOUT = StepLayout(max_num_tokens=64, max_num_seqs=4, max_pages=4)


def test_buckets():
    assert LAYOUT.batch_sizes == [1, 2, 4]
    assert LAYOUT.token_sizes == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]  # batch buckets, then as batch_buckets(64)
    assert token_buckets(20, 200) == [1, 2, 4, 8, 16, 20, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128, 144, 160,
                                      176, 192, 200]  # fmt: skip
    assert [bucket([1, 2, 4], n) for n in (1, 2, 3, 4)] == [1, 2, 4, 4]
    with pytest.raises(ValueError, match="beyond the largest bucket"):
        bucket([1, 2, 4], 5)


def test_pack_of_a_mixed_step():
    """Two prefill chunks (one over a cached prefix) then two decodes, the second fed on the device:
    every region by hand, padded to the token bucket (33 -> 40) and the sampled rows to the batch
    bucket (3 -> 4)."""
    a = _seq("a", 20, 0, 20, [4, 9])  # a whole 20-token prompt
    b = _seq("b", 40, 16, 11, [3, 7], samples=False)  # a chunk after 16 cached tokens: not the last
    c = _decode("c", 5, [2], 77)
    d = _decode("d", 40, [5, 6, 1], None)  # its token comes from row 2 of the previous step's samples
    host = np.full(LAYOUT.num_words, -1, np.int32)
    packed = LAYOUT.pack(host, [a, b, c, d], _sampling(3), fed_sources=[2])
    assert packed.shape == StepShape(num_tokens=40, num_prefill_tokens=31, prefill_max_new_tokens=20, num_prefill_seqs=2,
                                     prefill_width=2, num_decode_rows=2, decode_width=MIN_TABLE_WIDTH, num_sampled=4)  # fmt: skip
    assert (packed.num_sampled, packed.fed_rows) == (3, (32, 1))
    region = lambda offset, n: host[offset : offset + n].tolist()  # noqa: E731
    padding = [0] * 7
    assert region(LAYOUT.tokens, 40) == list(range(100, 120)) + list(range(116, 127)) + [77, 0] + padding
    assert region(LAYOUT.positions, 40) == list(range(20)) + list(range(16, 27)) + [5, 40] + padding
    want_kv = [4 * 16 + p for p in range(16)] + [9 * 16 + p for p in range(4)] + [7 * 16 + p for p in range(11)]
    assert region(LAYOUT.kv_indices, 40) == want_kv + [2 * 16 + 5, 1 * 16 + 8] + padding  # padding: slot 0 of the null page
    assert region(LAYOUT.cu_seqlens, 3) == [0, 20, 31]
    assert region(LAYOUT.start_pos, 2) == [0, 16]
    assert region(LAYOUT.context_lens, 2) == [6, 41]
    assert region(LAYOUT.fed_sources, 1) == [2]
    tables = LAYOUT.tables
    assert region(tables, 2 * MIN_TABLE_WIDTH) == [2] + [0] * 7 + [5, 6, 1] + [0] * 5  # decode tables, the graphs' width
    assert region(tables + 2 * MIN_TABLE_WIDTH, 4) == [4, 9, 3, 7]  # prefill tables right after
    assert packed.num_words == tables + 2 * MIN_TABLE_WIDTH + 4
    assert region(LAYOUT.sample_rows, 4) == [19, 31, 32, 0]  # a's last token, c's, d's; b is mid-prompt; padding row 0
    assert host[LAYOUT.temperatures : LAYOUT.temperatures + 4].view(np.float32).tolist() == [0, 0.5, 1, 0]
    assert host[LAYOUT.seeds : LAYOUT.seeds + 4].view(np.uint32).tolist() == [7, 8, 9, 0]
    assert region(LAYOUT.steps, 4) == [3, 4, 5, 0]


def test_pack_of_a_decode_step_pads_the_batch_with_null_decodes():
    host = np.full(LAYOUT.num_words, -1, np.int32)
    packed = LAYOUT.pack(host, [_decode("x", 3, [6], 11), _decode("y", 17, [8, 2, 9, 3, 4, 5, 1, 7, 10], 12)], _sampling(2))
    # 2 rows: bucket 2; a 9-page table: width 16
    assert packed.shape == StepShape(2, 0, 0, 0, 0, 2, 16, 2)
    packed = LAYOUT.pack(host, [_decode(r, 3, [6], 11) for r in "xyz"], _sampling(3))
    assert packed.shape == StepShape(4, 0, 0, 0, 0, 4, MIN_TABLE_WIDTH, 4)
    assert host[LAYOUT.tokens : LAYOUT.tokens + 4].tolist() == [11, 11, 11, 0]
    assert host[LAYOUT.kv_indices : LAYOUT.kv_indices + 4].tolist() == [6 * 16 + 3] * 3 + [0]
    assert host[LAYOUT.context_lens : LAYOUT.context_lens + 4].tolist() == [4, 4, 4, 1]  # the padding row sees its slot
    assert host[LAYOUT.tables + 3 * MIN_TABLE_WIDTH : LAYOUT.tables + 4 * MIN_TABLE_WIDTH].tolist() == [0] * MIN_TABLE_WIDTH
    assert host[LAYOUT.sample_rows : LAYOUT.sample_rows + 4].tolist() == [0, 1, 2, 0]


def test_pack_rejects_what_it_cannot_place():
    host = np.zeros(LAYOUT.num_words, np.int32)
    c = _decode("c", 5, [2], 77)
    with pytest.raises(ValueError, match="before decoding ones"):
        LAYOUT.pack(host, [c, _seq("a", 4, 0, 4, [1])], _sampling(2))
    with pytest.raises(ValueError, match="fed exactly when it is unknown"):
        LAYOUT.pack(host, [c], _sampling(1), fed_sources=[0])
    with pytest.raises(ValueError, match="fed exactly when it is unknown"):
        LAYOUT.pack(host, [_decode("d", 5, [2], None)], _sampling(1))
    with pytest.raises(ValueError, match="beyond the largest bucket"):
        LAYOUT.pack(host, [_seq("a", 70, 0, 65, [1, 2, 3, 4, 5])], _sampling(1))


def test_null_sequences_touch_only_the_null_page():
    host = np.zeros(LAYOUT.num_words, np.int32)
    seqs = null_sequences(20, 3, decode_pages=4)
    packed = LAYOUT.pack(host, seqs, _sampling(4))
    assert packed.shape == StepShape(24, 20, 20, 1, 2, 3, MIN_TABLE_WIDTH, 4)
    kv = host[LAYOUT.kv_indices : LAYOUT.kv_indices + 24]
    assert kv.min() >= 0 and kv.max() < 16  # slots of page 0
    assert host[LAYOUT.tables : LAYOUT.tables + 3 * MIN_TABLE_WIDTH + 2].tolist() == [0] * (3 * MIN_TABLE_WIDTH + 2)


def test_views_are_the_regions_of_the_device_buffer():
    host = np.zeros(LAYOUT.num_words, np.int32)
    packed = LAYOUT.pack(host, [_seq("a", 20, 0, 20, [4, 9]), _decode("c", 5, [2], 77)], _sampling(2))
    device, tokens = cuda.to_device(host), cuda.device_array(4, np.int32)
    inputs, sampler = LAYOUT.views(device, packed.shape, tokens)
    assert inputs.token_ids.copy_to_host().tolist() == list(range(100, 120)) + [77] + [0] * 3  # 21 -> 24
    assert inputs.num_prefill_tokens == 20 and inputs.prefill_max_new_tokens == 20
    assert inputs.prefill_cu_seqlens.copy_to_host().tolist() == [0, 20]
    assert inputs.prefill_block_tables.copy_to_host().tolist() == [[4, 9]]
    assert inputs.decode_block_tables.shape == (1, MIN_TABLE_WIDTH)
    assert inputs.decode_context_lens.copy_to_host().tolist() == [6]
    assert inputs.sample_rows.copy_to_host().tolist() == [19, 20]
    assert sampler.temperatures.copy_to_host().tolist() == [0, 0.5] and sampler.tokens.shape == (2,)
    decode_only = LAYOUT.pack(host, [_decode("c", 5, [2], 77)], _sampling(1)).shape
    assert LAYOUT.views(device, decode_only, tokens)[0].prefill_cu_seqlens is None
