"""The device pool: fixed-size pages shared by KV blocks and adapter rank rows.

FastLibra §4.3 ("Unified Caching Pool for LoRAs and KVs"): device memory is cut into
pages of one size, a page holds one KV block (keys and values of `block_size` tokens
across every layer), and an adapter takes as many pages as its rank rows fill
(`pages_for`), so the split between KV and adapters follows the load instead of being
fixed. Page ids are the KV cache's block indices.

This class is the ledger: it knows who owns every page and hands out free ones; it moves
no data. Every page is free or has exactly one owner: a running request (its private
blocks), a node of the prefix tree (cached KV), or an adapter. `check` asserts that.
The data follows the ledger: an adapter is written into the very pages it was given
where the engine keeps adapters in the KV cache (the reference and MBGMV backends on
one device, `KVPagesBackend`); elsewhere (BGMV, a tensor-parallel mesh, lora_pool
"slots") its weights sit in the backend's own slots and its pages only stand for their
bytes.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Hashable, Iterable

KV, LORA = "kv", "lora"


class OutOfPages(RuntimeError):
    """Not enough free pages right now."""


class PagePool:
    """`num_pages` pages of `page_bytes`; see the module docstring."""

    def __init__(self, num_pages: int, page_bytes: int) -> None:
        if num_pages < 1 or page_bytes < 1:
            raise ValueError(f"{num_pages=} and {page_bytes=} must be positive")
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self._free = list(range(num_pages - 1, -1, -1))  # LIFO: recently freed first
        self._owner: dict[int, tuple[str, Hashable]] = {}  # page -> (kind, owner)
        self._used: collections.Counter[str] = collections.Counter()  # pages per kind

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, nbytes: int) -> int:
        return math.ceil(nbytes / self.page_bytes)

    def used(self, kind: str) -> int:
        return self._used[kind]

    @property
    def usage(self) -> float:
        """The share of pages in use, 0..1."""
        return 1.0 - len(self._free) / self.num_pages

    def allocate(self, count: int, kind: str, owner: Hashable) -> list[int]:
        if count > len(self._free):
            raise OutOfPages(f"need {count} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(count)]
        for page in pages:
            self._owner[page] = (kind, owner)
        self._used[kind] += count
        return pages

    def transfer(self, pages: Iterable[int], owner: Hashable) -> None:
        """Give pages to a new owner (a request's block becomes a cached node's)."""
        for page in pages:
            kind, _ = self._owner[page]
            self._owner[page] = (kind, owner)

    def free(self, pages: Iterable[int]) -> None:
        for page in pages:
            if page not in self._owner:
                raise ValueError(f"page {page} is not allocated")
            kind, _ = self._owner.pop(page)
            self._used[kind] -= 1
            self._free.append(page)

    def owned(self) -> dict[int, tuple[str, Hashable]]:
        return dict(self._owner)

    def check(self) -> None:
        """Every page is either free (once) or owned (once)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is free twice"
        assert not free & self._owner.keys(), "a page is both free and owned"
        assert len(free) + len(self._owner) == self.num_pages, "pages leaked"
        kinds = collections.Counter(kind for kind, _ in self._owner.values())
        assert kinds == +self._used, "the pages per kind drifted"
