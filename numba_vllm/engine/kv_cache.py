"""Page accounting for the paged KV cache: which pages each request holds, and which hold a reusable prefix.

The device pool is allocated once at start-up: per layer, K and V of shape
``(num_pages, PAGE_SIZE, KVH, HD)`` bf16. A sequence's K/V is spread over pages in any order; its
block table (``Request.page_ids``) lists them in token order, so token ``pos`` of the sequence sits
at kv index ``page_ids[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE``. This module only hands out
page *ids*; it never touches device memory.

Page 0 is the null page: never handed out, so block tables can be padded with it (a padded entry
points at real, harmless memory instead of out of bounds), and a padding token of a step can write
its K/V there without clobbering anyone's cache.

With prefix caching (`engine/prefix_cache.py`) a full page can be in several block tables at once:
each page has a reference count (the block tables it is in), and a page whose K/V is known to be
that of a given token prefix carries that prefix's hash, so a later request can find it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from numba_vllm.model.config import PAGE_SIZE

NULL_PAGE_ID = 0  # reserved page: padding for block tables and padding tokens, never allocated
MAX_KV_INDEX = 2**31 - 1  # kv indices are int32 on the device

PageHash = bytes  # a page's chained prefix hash (`prefix_cache.page_hash`)


class OutOfPagesError(RuntimeError):
    """More pages were asked for than are free (callers check `can_allocate` first)."""


class PageFreeError(ValueError):
    """A page was freed that is not held: a double free, the null page, or an id out of range."""


class PageAllocator:
    """Hands out the ids of a pool of ``num_pages`` pages (page 0 reserved), with reference counts.

    A page is *held* while its reference count (the number of block tables it is in) is above 0, and
    *free* at 0. Without prefix caching every held page is in exactly one block table.

    Free pages wait in one ordered map, ``OrderedDict`` (a hash map threaded on a doubly linked
    list): O(1) at both ends and O(1) removal from the middle by id. The order depends on the mode:

    - prefix caching off: a stack. The most recently freed page is handed out first (simplest, and
      a recently freed page may even still be in L2); no free page is worth more than another.
    - prefix caching on: a least-recently-used queue. A freed page keeps its K/V and its hash, so a
      later request with the same prefix can take it back (`share`, which unlinks it from the middle
      of the queue: why a plain list or deque will not do). `allocate` hands out the page freed
      longest ago, evicting its hash, so the prefixes used most recently survive longest. As in
      vLLM, cached and uncached free pages share the one queue; a fresh pool's pages come first.

    A page is never evicted or handed out while held: only free pages are in the queue. Alongside,
    the reference counts make a double free an immediate, named error, and `check_invariants`
    proves that no page is ever handed out twice.
    """

    def __init__(self, num_pages: int, enable_caching: bool = False) -> None:
        if not isinstance(num_pages, int) or num_pages < 2:
            raise ValueError(f"num_pages must be an integer >= 2 (page 0 is the reserved null page), got {num_pages!r}")
        if num_pages * PAGE_SIZE - 1 > MAX_KV_INDEX:
            raise ValueError(f"num_pages={num_pages}: kv indices would overflow int32 (at most {MAX_KV_INDEX // PAGE_SIZE})")
        self.num_pages = num_pages  # pool size, the null page included
        self.enable_caching = enable_caching
        # Free pages; the next handed out is at the end (stack) or at the front (LRU queue). Either
        # way a fresh pool hands out 1, 2, 3, ...
        order = range(1, num_pages) if enable_caching else range(num_pages - 1, NULL_PAGE_ID, -1)
        self._free_page_ids: OrderedDict[int, None] = OrderedDict.fromkeys(order)
        self._ref_counts = [0] * num_pages  # (num_pages,) block tables holding each page; the null page's stays 0
        self._num_held = 0
        self._hash_of_page: dict[int, PageHash] = {}  # cached pages, held or free
        self._page_of_hash: dict[PageHash, int] = {}  # the inverse: where a prefix's K/V is

    # ---- counts ----------------------------------------------------------------------------------
    @property
    def num_usable_pages(self) -> int:
        """Pages that can ever be handed out: all but the null page."""
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        """Pages no block table holds (cached ones included: allocating one evicts it)."""
        return len(self._free_page_ids)

    @property
    def num_allocated_pages(self) -> int:
        """Pages held by at least one block table."""
        return self._num_held

    @property
    def num_cached_pages(self) -> int:
        """Pages whose K/V a later request with the same prefix can reuse (held or free)."""
        return len(self._page_of_hash)

    def ref_count(self, page_id: int) -> int:
        return self._ref_counts[page_id]

    def is_cached(self, page_id: int) -> bool:
        return page_id in self._hash_of_page

    def num_free_among(self, page_ids: Sequence[int]) -> int:
        """How many of ``page_ids`` are free: `share` takes those out of the free pages."""
        return sum(1 for page_id in page_ids if self._ref_counts[page_id] == 0)

    # ---- handing out and taking back -------------------------------------------------------------
    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free_page_ids)

    def allocate(self, num_pages: int) -> list[int]:
        """Take ``num_pages`` free pages (evicting their cached prefixes); raises `OutOfPagesError`
        (and takes none) if too few are free."""
        if not isinstance(num_pages, int) or num_pages < 0:
            raise ValueError(f"num_pages must be a non-negative integer, got {num_pages!r}")
        if num_pages > len(self._free_page_ids):
            raise OutOfPagesError(f"asked for {num_pages} pages, {len(self._free_page_ids)} free of {self.num_usable_pages}")
        if num_pages == 0:  # most decode steps of most sequences
            return []
        lru = self.enable_caching
        page_ids = [self._free_page_ids.popitem(last=not lru)[0] for _ in range(num_pages)]
        for page_id in page_ids:
            assert page_id != NULL_PAGE_ID and self._ref_counts[page_id] == 0, f"page {page_id} handed out twice"
            self._ref_counts[page_id] = 1
            page_hash = self._hash_of_page.pop(page_id, None)
            if page_hash is not None:  # evicted: its K/V is about to be overwritten
                del self._page_of_hash[page_hash]
        self._num_held += num_pages
        return page_ids

    def share(self, page_ids: Sequence[int]) -> None:
        """Add a block table's reference to cached pages (a prefix-cache hit); a free one leaves the
        free pages, so it can no longer be evicted."""
        for page_id in page_ids:
            if page_id not in self._hash_of_page:
                raise ValueError(f"page {page_id} holds no cached prefix; only cached pages are shared")
        for page_id in page_ids:
            if self._ref_counts[page_id] == 0:
                del self._free_page_ids[page_id]
                self._num_held += 1
            self._ref_counts[page_id] += 1

    def free(self, page_ids: Sequence[int]) -> None:
        """Drop one block table's reference to each page; a page nobody holds any more becomes free.
        All are checked before any is freed, so an error frees none.

        Taken in reverse, so a block table's last page is freed first: the next `allocate` of the
        same size hands back the same ids in the same order (stack), and the tail of a sequence is
        evicted before its head (LRU queue), since a prefix's first pages are the likeliest reused.
        """
        seen: set[int] = set()
        for page_id in page_ids:
            held = 0 < page_id < self.num_pages and self._ref_counts[page_id] > 0
            if not held or page_id in seen:
                what = "the null page" if page_id == NULL_PAGE_ID else "not allocated (double free?)"
                raise PageFreeError(f"cannot free page {page_id}: {what}")
            seen.add(page_id)
        for page_id in reversed(page_ids):
            self._ref_counts[page_id] -= 1
            if self._ref_counts[page_id] == 0:
                self._free_page_ids[page_id] = None  # the end: most recently used
                self._num_held -= 1

    # ---- the prefix cache's index ----------------------------------------------------------------
    def lookup(self, page_hash: PageHash) -> int | None:
        """The page holding the K/V of the prefix with this hash, if any (held or free)."""
        return self._page_of_hash.get(page_hash)

    def cache(self, page_id: int, page_hash: PageHash) -> bool:
        """Record that a held, full page holds the K/V of the prefix with this hash. False (and
        nothing recorded) if another page already holds that prefix: two requests computed it in
        the same step, and the second copy stays uncached."""
        if not self.enable_caching:
            raise ValueError("prefix caching is off for this allocator")
        if self._ref_counts[page_id] == 0:
            raise ValueError(f"page {page_id} is not held; only a held page's contents are known")
        known = self._hash_of_page.get(page_id)
        if known is not None:
            assert known == page_hash, f"page {page_id} cached under two hashes"
            return True
        if page_hash in self._page_of_hash:
            return False
        self._hash_of_page[page_id] = page_hash
        self._page_of_hash[page_hash] = page_id
        return True

    # ---- checks ----------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Every usable page is exactly one of free (count 0) / held (count > 0); the null page is
        neither; the hash index is one-to-one."""
        assert self._ref_counts[NULL_PAGE_ID] == 0 and NULL_PAGE_ID not in self._free_page_ids, "the null page is in use"
        for page_id in range(1, self.num_pages):
            count = self._ref_counts[page_id]
            assert count >= 0, f"page {page_id} has reference count {count}"
            assert (count == 0) == (page_id in self._free_page_ids), f"page {page_id}: count {count} but free={count == 0}"
        assert set(self._free_page_ids) <= set(range(1, self.num_pages)), "a free page is out of range"
        assert self._num_held == self.num_usable_pages - len(self._free_page_ids), "the held-page count is off"
        assert len(self._hash_of_page) == len(self._page_of_hash), "the hash index is not one-to-one"
        assert all(self._page_of_hash.get(h) == p for p, h in self._hash_of_page.items()), "the hash index is not one-to-one"
        assert self.enable_caching or not self._hash_of_page, "a page is cached with prefix caching off"

    @property
    def allocated_page_ids(self) -> frozenset[int]:
        """A snapshot of the held ids (for checks and tests; O(pages))."""
        return frozenset(p for p in range(1, self.num_pages) if self._ref_counts[p] > 0)


def pages_for_tokens(num_tokens: int) -> int:
    """Pages needed to hold ``num_tokens`` tokens: ceil(num_tokens / PAGE_SIZE)."""
    return -(-num_tokens // PAGE_SIZE)
