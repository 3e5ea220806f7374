"""The physical KV blocks of one pool: which are free and how many owners each has."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class BlockPool:
    """A fixed set of block ids ``0 .. num_blocks-1`` with reference counts.

    A block is free exactly when its reference count is zero. Free blocks wait in one
    queue, least recently freed first, and are handed out from its front, which keeps
    allocation deterministic (tests assert exact ids) and makes the queue the evictor of
    the prefix cache: a free block may still hold a cached prefix, and it is only lost
    when the block is handed out again (``on_evict`` is told). A cached free block that
    a new request hits is taken back out of the queue with ``revive``.

    Sharing (parallel samples, beams, prefix hits) raises a block's count with
    ``incref``; ``decref`` returns it to the back of the queue when the last owner lets
    go.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.on_evict: Callable[[int], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def is_free(self, block_id: int) -> bool:
        return self._ref_counts[block_id] == 0

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take ``num_blocks`` free blocks (ref count 1 each), or ``None`` if too few."""
        if num_blocks > len(self._free_block_ids):
            return None
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free_block_ids.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(block_id)
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def allocate_contiguous(self, num_blocks: int) -> list[int] | None:
        """Take ``num_blocks`` free blocks with consecutive ids (first fit, lowest ids
        first), or ``None`` when no free run is that long: the contiguous reservation of
        the baselines the paper compares with, fragmentation included."""
        start = self._first_free_run(num_blocks)
        if start is None:
            return None
        block_ids = list(range(start, start + num_blocks))
        for block_id in block_ids:
            del self._free_block_ids[block_id]
            if self.on_evict is not None:
                self.on_evict(block_id)
            self._ref_counts[block_id] = 1
        return block_ids

    def largest_free_run(self) -> int:
        """The most blocks one contiguous allocation could get now."""
        longest = run = 0
        for count in self._ref_counts:
            run = run + 1 if count == 0 else 0
            longest = max(longest, run)
        return longest

    def _first_free_run(self, num_blocks: int) -> int | None:
        if num_blocks == 0:
            return 0
        run = 0
        for block_id, count in enumerate(self._ref_counts):
            run = run + 1 if count == 0 else 0
            if run == num_blocks:
                return block_id - num_blocks + 1
        return None

    def revive(self, block_id: int) -> None:
        """Take a free block back out of the queue, keeping its contents (a prefix-cache
        hit on a block no request holds)."""
        if self._ref_counts[block_id] != 0:
            raise RuntimeError(f"revive of block {block_id}, which is in use")
        del self._free_block_ids[block_id]
        self._ref_counts[block_id] = 1

    def incref(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                raise RuntimeError(f"incref of free block {block_id}")
            self._ref_counts[block_id] += 1

    def decref(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; blocks reaching zero join the back of the
        free queue in the given order."""
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count <= 0:
                raise RuntimeError(f"double free of block {block_id}")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                self._free_block_ids[block_id] = None

    def check_integrity(self, expected_ref_counts: dict[int, int]) -> None:
        """Raise ``AssertionError`` unless the pool agrees with the owners' view.

        ``expected_ref_counts`` maps every block some owner holds to the number of
        holders. Free + used == total, no negative count, no block both free and held.
        """
        free = self._free_block_ids
        for block_id, count in enumerate(self._ref_counts):
            if count < 0:
                raise AssertionError(f"block {block_id} has negative ref count {count}")
            if (count == 0) != (block_id in free):
                raise AssertionError(
                    f"block {block_id}: ref count {count} but free={block_id in free}"
                )
            expected = expected_ref_counts.get(block_id, 0)
            if count != expected:
                raise AssertionError(
                    f"block {block_id}: ref count {count} but {expected} holder(s) point at it"
                )
        used = sum(1 for count in self._ref_counts if count > 0)
        if used + len(free) != self.num_blocks:
            raise AssertionError(f"free {len(free)} + used {used} != total {self.num_blocks}")
