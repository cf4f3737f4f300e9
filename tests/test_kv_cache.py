"""The page allocator: exact page ids, on the CPU."""


import numpy as np
import pytest

from numba_vllm.engine.kv_cache import NULL_PAGE_ID, OutOfPagesError, PageAllocator, PageFreeError, pages_for_tokens


def test_fresh_pool_hands_out_ascending_ids_and_reuses_the_most_recently_freed():
    allocator = PageAllocator(8)
    assert (allocator.num_usable_pages, allocator.num_free_pages) == (7, 7)
    assert allocator.allocate(3) == [1, 2, 3]
    assert allocator.allocate(2) == [4, 5]
    assert allocator.num_free_pages == 2 and allocator.num_allocated_pages == 5
    allocator.free([2, 3])
    assert allocator.allocate(2) == [2, 3]  # same ids, same order
    allocator.free([4])
    assert allocator.allocate(1) == [4]
    assert allocator.allocate(0) == []
    assert allocator.allocate(2) == [6, 7]
    assert allocator.num_free_pages == 0
    allocator.check_invariants()


def test_exhaustion_raises_and_takes_nothing():
    allocator = PageAllocator(4)
    assert allocator.can_allocate(3) and not allocator.can_allocate(4)
    assert allocator.allocate(3) == [1, 2, 3]
    assert not allocator.can_allocate(1) and allocator.can_allocate(0)
    with pytest.raises(OutOfPagesError):
        allocator.allocate(1)
    assert allocator.num_free_pages == 0 and allocator.num_allocated_pages == 3
    allocator.free([1, 2, 3])
    with pytest.raises(OutOfPagesError):
        allocator.allocate(4)
    assert allocator.num_free_pages == 3
    allocator.check_invariants()


def test_bad_frees_are_errors_and_free_nothing():
    allocator = PageAllocator(6)
    page_ids = allocator.allocate(3)  # [1, 2, 3]
    allocator.free([2])
    with pytest.raises(PageFreeError, match="page 2"):
        allocator.free([2])  # double free
    with pytest.raises(PageFreeError, match="null page"):
        allocator.free([NULL_PAGE_ID])
    with pytest.raises(PageFreeError):
        allocator.free([4])  # never allocated
    with pytest.raises(PageFreeError):
        allocator.free([99])  # out of range
    with pytest.raises(PageFreeError):
        allocator.free([1, 3, 1])  # 1 twice in one call: nothing is freed
    assert allocator.allocated_page_ids == {1, 3}
    allocator.free([page_ids[0], page_ids[2]])
    assert allocator.num_free_pages == 5
    allocator.check_invariants()


def test_bad_pool_sizes_are_rejected():
    for num_pages in (0, 1, -3, 2.0):
        with pytest.raises(ValueError):
            PageAllocator(num_pages)
    with pytest.raises(ValueError, match="int32"):
        PageAllocator(2**27 + 1)
    with pytest.raises(ValueError):
        PageAllocator(4).allocate(-1)


def test_null_page_is_never_handed_out():
    allocator = PageAllocator(10)
    assert sorted(allocator.allocate(9)) == list(range(1, 10))
    allocator.free(list(range(1, 10)))
    assert NULL_PAGE_ID not in allocator.allocate(9)


def test_no_page_handed_out_twice_under_random_allocate_and_free():
    rng = np.random.default_rng(0)
    allocator = PageAllocator(33)
    holders: list[list[int]] = []  # each like a request's block table
    for _ in range(2000):
        if holders and (rng.random() < 0.45 or not allocator.can_allocate(1)):
            allocator.free(holders.pop(int(rng.integers(len(holders)))))
        else:
            n = int(rng.integers(0, 6))
            if allocator.can_allocate(n):
                holders.append(allocator.allocate(n))
            else:
                with pytest.raises(OutOfPagesError):
                    allocator.allocate(n)
        held = [p for h in holders for p in h]
        assert len(held) == len(set(held)) == allocator.num_allocated_pages
        assert NULL_PAGE_ID not in held and all(1 <= p < 33 for p in held)
        assert allocator.num_free_pages + len(held) == 32
        allocator.check_invariants()


def test_pages_for_tokens():
    assert [pages_for_tokens(n) for n in (0, 1, 15, 16, 17, 31, 32, 33, 100)] == [0, 1, 1, 1, 2, 2, 2, 3, 7]
