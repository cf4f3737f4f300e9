"""Page accounting for the paged KV cache: which pages each request holds.

The device pool is allocated once at start-up: per layer, K and V of shape
``(num_pages, PAGE_SIZE, KVH, HD)`` bf16. A sequence's K/V is spread over pages in any order; its
block table (``Request.page_ids``) lists them in token order, so token ``pos`` of the sequence sits
at kv index ``page_ids[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE``. This module only hands out
page *ids*; it never touches device memory.

Page 0 is the null page: never handed out, so block tables can be padded with it (a padded entry
points at real, harmless memory instead of out of bounds), and a padding token of a step can write
its K/V there without clobbering anyone's cache.
"""

from __future__ import annotations

from collections.abc import Sequence

from numba_vllm.model.config import PAGE_SIZE

NULL_PAGE_ID = 0  # reserved page: padding for block tables and padding tokens, never allocated
MAX_KV_INDEX = 2**31 - 1  # kv indices are int32 on the device


class OutOfPagesError(RuntimeError):
    """More pages were asked for than are free (callers check `can_allocate` first)."""


class PageFreeError(ValueError):
    """A page was freed that is not allocated: a double free, the null page, or an id out of range."""


class PageAllocator:
    """Hands out and takes back the ids of a pool of ``num_pages`` pages (page 0 reserved).

    Free list: a Python list used as a stack (push and pop at the end, O(1)); the most recently
    freed page is handed out first. vLLM keeps its free blocks in a doubly linked list instead,
    because with prefix caching a free block may still hold a reusable prefix: it must be evicted in
    least-recently-used order and unlinked from the middle when a new request hits it. We have no
    prefix cache, so no free page is worth more than another, nothing is removed from the middle,
    and a stack is the simplest correct structure (a recently freed page may even still be in L2).

    Alongside, the set of allocated ids makes a double free an immediate, named error and lets
    `check_invariants` prove that no page is ever handed out twice.
    """

    def __init__(self, num_pages: int) -> None:
        if not isinstance(num_pages, int) or num_pages < 2:
            raise ValueError(f"num_pages must be an integer >= 2 (page 0 is the reserved null page), got {num_pages!r}")
        if num_pages * PAGE_SIZE - 1 > MAX_KV_INDEX:
            raise ValueError(f"num_pages={num_pages}: kv indices would overflow int32 (at most {MAX_KV_INDEX // PAGE_SIZE})")
        self.num_pages = num_pages  # pool size, the null page included
        # Reversed so that pop() hands out 1, 2, 3, ... from a fresh pool.
        self._free_page_ids: list[int] = list(range(num_pages - 1, NULL_PAGE_ID, -1))
        self._allocated_page_ids: set[int] = set()

    @property
    def num_usable_pages(self) -> int:
        """Pages that can ever be handed out: all but the null page."""
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        return len(self._free_page_ids)

    @property
    def num_allocated_pages(self) -> int:
        return len(self._allocated_page_ids)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free_page_ids)

    def allocate(self, num_pages: int) -> list[int]:
        """Take ``num_pages`` free pages; raises `OutOfPagesError` (and takes none) if too few are free."""
        if not isinstance(num_pages, int) or num_pages < 0:
            raise ValueError(f"num_pages must be a non-negative integer, got {num_pages!r}")
        if num_pages > len(self._free_page_ids):
            raise OutOfPagesError(f"asked for {num_pages} pages, {len(self._free_page_ids)} free of {self.num_usable_pages}")
        split = len(self._free_page_ids) - num_pages
        page_ids = self._free_page_ids[split:][::-1]  # top of the stack first
        del self._free_page_ids[split:]
        for page_id in page_ids:
            assert page_id != NULL_PAGE_ID and page_id not in self._allocated_page_ids, f"page {page_id} handed out twice"
            self._allocated_page_ids.add(page_id)
        return page_ids

    def free(self, page_ids: Sequence[int]) -> None:
        """Return pages to the pool. All are checked before any is freed, so an error frees none.

        Pushed in reverse, so the next `allocate` of the same size hands back the same ids in the
        same order (handy to reason about; nothing depends on it).
        """
        seen: set[int] = set()
        for page_id in page_ids:
            if page_id not in self._allocated_page_ids or page_id in seen:
                what = "the null page" if page_id == NULL_PAGE_ID else "not allocated (double free?)"
                raise PageFreeError(f"cannot free page {page_id}: {what}")
            seen.add(page_id)
        for page_id in reversed(page_ids):
            self._allocated_page_ids.remove(page_id)
            self._free_page_ids.append(page_id)

    def check_invariants(self) -> None:
        """Every usable page is exactly one of free / allocated; the null page is neither."""
        free = set(self._free_page_ids)
        assert len(free) == len(self._free_page_ids), "a page is on the free list twice"
        assert not free & self._allocated_page_ids, "a page is both free and allocated"
        assert free | self._allocated_page_ids == set(range(1, self.num_pages)), "a page is lost or out of range"

    @property
    def allocated_page_ids(self) -> frozenset[int]:
        """A snapshot of the allocated ids (for checks and tests; O(pages))."""
        return frozenset(self._allocated_page_ids)


def pages_for_tokens(num_tokens: int) -> int:
    """Pages needed to hold ``num_tokens`` tokens: ceil(num_tokens / PAGE_SIZE)."""
    return -(-num_tokens // PAGE_SIZE)
