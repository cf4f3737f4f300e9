"""A step's inputs from the scheduler's sequences: block tables, kv indices, positions (exact, CPU)."""

import numpy as np
import pytest

from numba_vllm.engine.request import Request
from numba_vllm.engine.sampling import SamplingParams
from numba_vllm.engine.scheduler import ScheduledSequence
from numba_vllm.executor.inputs import MIN_TABLE_WIDTH, block_table_array, kv_index, kv_indices, step_arrays, table_width


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


def _seq(request_id, prompt_len, start, num_new, page_ids, samples=True):
    request = Request(request_id, list(range(100, 100 + prompt_len)), SamplingParams(), 0)
    tokens = request.token_ids_between(start, start + num_new)
    return ScheduledSequence(request, slot=0, start_position=start, token_ids=tokens, page_ids=page_ids, samples=samples)


def test_step_arrays_of_a_mixed_step():
    """Two prefill chunks (one over a cached prefix) then one decode: every array by hand."""
    a = _seq("a", 20, 0, 20, [4, 9])  # a whole 20-token prompt
    b = _seq("b", 40, 16, 10, [3, 7], samples=False)  # a chunk after 16 cached tokens: not the last
    c = _seq("c", 5, 0, 5, [2])
    c.request.output_token_ids.append(77)
    c = ScheduledSequence(c.request, slot=2, start_position=5, token_ids=[77], page_ids=[2], samples=True)  # decode
    arrays, num_prefill, longest = step_arrays([a, b, c])
    assert (num_prefill, longest) == (30, 20)
    assert arrays["token_ids"].tolist() == list(range(100, 120)) + list(range(116, 126)) + [77]
    assert arrays["positions"].tolist() == list(range(20)) + list(range(16, 26)) + [5]
    want_kv = [4 * 16 + p for p in range(16)] + [9 * 16 + p for p in range(4)] + [7 * 16 + p for p in range(10)] + [2 * 16 + 5]
    assert arrays["kv_indices"].tolist() == want_kv
    assert arrays["prefill_cu_seqlens"].tolist() == [0, 20, 30]
    assert arrays["prefill_start_pos"].tolist() == [0, 16]
    assert arrays["prefill_block_tables"].tolist() == [[4, 9], [3, 7]]
    assert arrays["decode_block_tables"].tolist() == [[2] + [0] * (MIN_TABLE_WIDTH - 1)]  # the graphs' width
    assert arrays["decode_context_lens"].tolist() == [6]
    assert arrays["sample_rows"].tolist() == [19, 30]  # a's last token and c's; b is mid-prompt
    assert all(v.dtype == np.int32 for v in arrays.values())
