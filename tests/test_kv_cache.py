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


# ---- with prefix caching: reference counts, the hash index, LRU eviction ------------------------

H = [bytes([i]) * 32 for i in range(10)]  # stand-ins for page hashes


def test_caching_pool_hands_out_least_recently_freed_first_and_a_table_tail_before_its_head():
    allocator = PageAllocator(8, enable_caching=True)
    assert allocator.allocate(3) == [1, 2, 3]  # a fresh pool: 1, 2, 3, ... as without caching
    assert allocator.allocate(2) == [4, 5]
    allocator.free([1, 2, 3])  # freed tail first: 3, 2, 1 join the queue after the never-used 6, 7
    allocator.free([4])
    assert allocator.allocate(3) == [6, 7, 3]
    assert allocator.allocate(3) == [2, 1, 4]
    assert allocator.num_free_pages == 0
    allocator.check_invariants()


def test_shared_pages_are_counted_and_freed_by_their_last_holder():
    allocator = PageAllocator(6, enable_caching=True)
    a = allocator.allocate(2)  # [1, 2]
    assert allocator.cache(1, H[1]) and allocator.cache(2, H[2])
    assert allocator.lookup(H[1]) == 1 and allocator.lookup(H[3]) is None and allocator.num_cached_pages == 2
    allocator.share([1, 2])  # a second block table
    allocator.share([1])  # a third
    assert [allocator.ref_count(p) for p in range(6)] == [0, 3, 2, 0, 0, 0]
    assert allocator.num_allocated_pages == 2 and allocator.num_free_pages == 3
    allocator.free(a)
    allocator.free([1, 2])
    assert [allocator.ref_count(p) for p in (1, 2)] == [1, 0] and allocator.num_free_pages == 4
    allocator.check_invariants()
    allocator.free([1])
    assert allocator.num_free_pages == 5 and allocator.num_allocated_pages == 0
    with pytest.raises(PageFreeError, match="page 1"):
        allocator.free([1])  # its last holder already freed it
    assert allocator.num_cached_pages == 2  # free pages keep their contents and hashes
    allocator.check_invariants()


def test_sharing_a_free_cached_page_takes_it_out_of_the_queue():
    allocator = PageAllocator(5, enable_caching=True)
    allocator.allocate(2)  # [1, 2]
    allocator.cache(1, H[1])
    allocator.free([1, 2])  # queue: 3, 4, 2, 1
    assert allocator.num_free_among([1, 2, 3]) == 3
    allocator.share([1])
    assert allocator.ref_count(1) == 1 and allocator.num_free_pages == 3 and allocator.num_free_among([1, 2]) == 1
    assert allocator.allocate(3) == [3, 4, 2]  # page 1 is held again: never handed out
    with pytest.raises(OutOfPagesError):
        allocator.allocate(1)
    allocator.check_invariants()


def test_allocating_a_cached_free_page_evicts_its_hash():
    allocator = PageAllocator(4, enable_caching=True)
    allocator.allocate(3)
    for page_id in (1, 2, 3):
        allocator.cache(page_id, H[page_id])
    allocator.free([3])
    allocator.free([1, 2])  # queue: 3, 2, 1
    assert allocator.allocate(2) == [3, 2]  # least recently freed first
    assert allocator.lookup(H[3]) is None and allocator.lookup(H[2]) is None and allocator.lookup(H[1]) == 1
    assert not allocator.is_cached(3) and allocator.is_cached(1) and allocator.num_cached_pages == 1
    assert allocator.cache(3, H[3])  # its new contents can be cached again
    allocator.check_invariants()


def test_cache_rules():
    allocator = PageAllocator(6, enable_caching=True)
    allocator.allocate(2)  # [1, 2]
    assert allocator.cache(1, H[1])
    assert allocator.cache(1, H[1])  # again: nothing changes
    assert not allocator.cache(2, H[1])  # the prefix is already in page 1: page 2 stays an uncached copy
    assert not allocator.is_cached(2) and allocator.lookup(H[1]) == 1
    with pytest.raises(ValueError, match="not held"):
        allocator.cache(3, H[3])
    with pytest.raises(ValueError, match="holds no cached prefix"):
        allocator.share([2])
    with pytest.raises(ValueError, match="prefix caching is off"):
        PageAllocator(6).cache(1, H[1])
    allocator.check_invariants()


def test_no_page_handed_out_twice_and_exact_counts_under_random_sharing():
    rng = np.random.default_rng(1)
    allocator = PageAllocator(33, enable_caching=True)
    holders: list[list[int]] = []  # block tables; a table may share cached pages of others
    next_hash = iter(range(10**6))
    for _ in range(3000):
        r = rng.random()
        if holders and (r < 0.4 or not allocator.can_allocate(1)):
            allocator.free(holders.pop(int(rng.integers(len(holders)))))
        elif r < 0.6:  # a hit: share up to 3 cached pages, held or free
            cached = [p for p in range(1, 33) if allocator.is_cached(p)]
            take = sorted(set(rng.choice(cached, min(3, len(cached))).tolist())) if cached else []
            free_before = allocator.num_free_pages
            allocator.share(take)
            assert allocator.num_free_pages == free_before - sum(1 for p in take if sum(h.count(p) for h in holders) == 0)
            holders.append(take)
        else:
            n = int(rng.integers(0, 6))
            if allocator.can_allocate(n):
                table = allocator.allocate(n)
                assert not any(p in h for h in holders for p in table), "a held page was handed out"
                for page_id in table:
                    if rng.random() < 0.5:
                        allocator.cache(page_id, next(next_hash).to_bytes(32, "little"))
                holders.append(table)
        counts = {p: sum(h.count(p) for h in holders) for p in range(1, 33)}
        assert all(allocator.ref_count(p) == counts[p] for p in counts)
        assert allocator.allocated_page_ids == {p for p, c in counts.items() if c}
        assert allocator.num_free_pages == sum(1 for c in counts.values() if c == 0)
        allocator.check_invariants()
