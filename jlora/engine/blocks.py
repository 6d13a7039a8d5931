"""Host-side ownership of the paged KV cache's blocks (see `jlora.model.kv_cache`)."""

from __future__ import annotations


class OutOfBlocks(RuntimeError):
    """Not enough free KV blocks for the request right now."""


class BlockAllocator:
    """A free list of block indices. Blocks are handed out in LIFO order (warm in cache)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfBlocks(f"need {count} KV blocks, {len(self._free)} free")
        blocks = [self._free.pop() for _ in range(count)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        for block in blocks:
            if block not in self._used:
                raise ValueError(f"KV block {block} is not allocated")
            self._used.remove(block)
            self._free.append(block)
