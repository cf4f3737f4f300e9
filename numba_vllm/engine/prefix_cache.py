"""Automatic prefix caching: a request reuses the K/V pages of any earlier request that began with
the same tokens, and prefills only the rest.

Only full pages are shared. A full page is named by a chained hash:

    h(page 0) = SHA-256(root || token ids 0..15)        root = SHA-256(DOMAIN || cache key)
    h(page i) = SHA-256(h(page i-1) || token ids 16i .. 16i+15)

so equal hashes mean equal *prefixes* (every token before the page's end), which is what a page's
K/V depends on: the keys and values at a position are computed from every token up to it. The cache
key folds in what else changes K/V (the model), and SHA-256 makes a collision, which would hand a
request someone else's K/V, practically impossible. Token ids are hashed as little-endian int64.

The allocator (`kv_cache.PageAllocator`) keeps the index hash -> page and the reference counts;
this module computes the hashes (once per request and page: they are kept on the `Request`), finds
a request's cached prefix, and records pages as cached once a step has computed them. A page is
recorded only after its step has run (`Scheduler.update`), never when it is scheduled, so no request
can find a page whose K/V is still being written in the same step.

The last known token is never taken from the cache: its logits are needed to sample the next token,
so at most ``(num_tokens - 1) // PAGE_SIZE`` pages are looked up. A prompt whose length is a multiple
of 16 thus recomputes its whole last page (as vLLM does), and the kernels see an ordinary chunk.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from numba_vllm.engine.kv_cache import PageAllocator, PageHash
from numba_vllm.engine.request import Request
from numba_vllm.model.config import PAGE_SIZE

HASH_DOMAIN = b"numba-vllm prefix cache v1\0"  # changes if the hashing scheme ever does
_PAGE_TOKENS = struct.Struct(f"<{PAGE_SIZE}q")  # a full page's token ids as little-endian int64


def root_hash(cache_key: bytes) -> PageHash:
    """The parent of every sequence's first page: depends on the cache key (the model) alone."""
    return hashlib.sha256(HASH_DOMAIN + cache_key).digest()


def page_hash(parent: PageHash, token_ids: Sequence[int]) -> PageHash:
    """The hash of a full page: its parent page's hash and its ``PAGE_SIZE`` token ids."""
    if len(token_ids) != PAGE_SIZE:
        raise ValueError(f"only full pages are hashed: got {len(token_ids)} tokens, not {PAGE_SIZE}")
    return hashlib.sha256(parent + _PAGE_TOKENS.pack(*token_ids)).digest()


class PrefixCache:
    """Finds a request's cached prefix and records the pages its steps fill; counts queries and hits."""

    def __init__(self, allocator: PageAllocator, cache_key: bytes = b"") -> None:
        if not allocator.enable_caching:
            raise ValueError("the allocator was built without prefix caching (PageAllocator(..., enable_caching=True))")
        self.allocator = allocator
        self.root = root_hash(cache_key)
        self.num_queries = 0  # known tokens of admitted requests, looked up in the cache
        self.num_hits = 0  # of those, tokens found cached (so not recomputed)

    def find(self, request: Request) -> list[int]:
        """The cached pages that begin the request's known tokens: the longest run of its full pages
        whose hashes the cache holds, leaving at least its last token to compute. No side effects
        beyond computing (and keeping) hashes."""
        page_ids = []
        for i in range((request.num_tokens - 1) // PAGE_SIZE):
            page_id = self.allocator.lookup(self._hash(request, i))
            if page_id is None:
                break
            page_ids.append(page_id)
        return page_ids

    def count(self, request: Request, num_cached_tokens: int) -> None:
        """Count an admission: all its known tokens were looked up, ``num_cached_tokens`` found."""
        self.num_queries += request.num_tokens
        self.num_hits += num_cached_tokens

    def cache_full_pages(self, request: Request, start: int, end: int) -> None:
        """A step computed the request's tokens ``start .. end - 1``: record the pages it filled."""
        for i in range(start // PAGE_SIZE, end // PAGE_SIZE):
            self.allocator.cache(request.page_ids[i], self._hash(request, i))

    def _hash(self, request: Request, index: int) -> PageHash:
        """The hash of the request's full page ``index``, computing those before it as needed."""
        hashes = request.page_hashes
        while len(hashes) <= index:
            i = len(hashes)
            token_ids = request.token_ids_between(i * PAGE_SIZE, (i + 1) * PAGE_SIZE)
            hashes.append(page_hash(hashes[-1] if hashes else self.root, token_ids))
        return hashes[index]
