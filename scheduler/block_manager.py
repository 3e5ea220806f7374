"""Block tables: which physical blocks hold each request's KV cache."""

from __future__ import annotations

from collections import Counter

from pagedserve.scheduler.block_pool import BlockPool


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    """Maps each request's logical blocks to physical ones in a ``BlockPool``.

    Token ``t`` of a request lives in logical block ``t // block_size`` at offset
    ``t % block_size``; the block table turns the logical block into a physical id::

        tokens   0..15 | 16..31 | 32..40
        logical    0   |    1   |    2        block_size = 16
        table    [ 7   ,    2   ,    9 ]      physical ids, any order

    Blocks are allocated on demand as a request grows and all returned by ``free``.
    Checks and actions come in pairs (``can_allocate``/``allocate``,
    ``can_append``/``append``, ``can_swap_out``/``swap_out``, ``can_swap_in``/``swap_in``);
    the actions return the new block ids (or block pairs to copy), or ``None`` when the
    pool cannot supply them. Capacity is a value, never an exception.

    A second pool of host blocks receives swapped-out requests: their device table
    moves to ``host_block_tables`` until they are swapped back in.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        watermark_blocks: int = 0,
        num_host_blocks: int = 0,
    ) -> None:
        if block_size not in (8, 16, 32):
            raise ValueError(f"block_size must be one of 8, 16, 32 (tokens), got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.host_pool = BlockPool(num_host_blocks) if num_host_blocks > 0 else None
        # Admissions keep this many blocks spare so a newly admitted request does not
        # force a running one out on its very next step.
        self.watermark_blocks = watermark_blocks
        self.block_tables: dict[str, list[int]] = {}
        self.host_block_tables: dict[str, list[int]] = {}

    @property
    def num_total_host_blocks(self) -> int:
        return self.host_pool.num_blocks if self.host_pool else 0

    @property
    def num_free_host_blocks(self) -> int:
        return self.host_pool.num_free_blocks if self.host_pool else 0

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks a request must gain so that ``num_tokens`` tokens have a slot."""
        held = len(self.block_tables.get(request_id, ()))
        return max(0, blocks_for_tokens(num_tokens, self.block_size) - held)

    def can_allocate(self, num_tokens: int, keep_watermark: bool = True) -> bool:
        """Whether a new request could get slots for ``num_tokens`` tokens.

        With ``keep_watermark`` the pool must keep ``watermark_blocks`` spare afterwards;
        the caller drops it when nothing is running, since the watermark only protects
        running requests and would otherwise block a request that fits the cache.
        """
        needed = blocks_for_tokens(num_tokens, self.block_size)
        reserve = self.watermark_blocks if keep_watermark else 0
        return needed + reserve <= self.pool.num_free_blocks

    def allocate(
        self, request_id: str, num_tokens: int, keep_watermark: bool = True
    ) -> list[int] | None:
        """Create the block table of a new request with room for ``num_tokens`` tokens."""
        if request_id in self.block_tables:
            raise RuntimeError(f"request {request_id!r} already has a block table")
        if not self.can_allocate(num_tokens, keep_watermark):
            return None
        block_ids = self.pool.allocate(blocks_for_tokens(num_tokens, self.block_size))
        assert block_ids is not None
        self.block_tables[request_id] = block_ids
        return list(block_ids)

    def can_append(self, request_id: str, num_tokens: int) -> bool:
        """Whether the request's table can grow to hold ``num_tokens`` tokens in all."""
        return self.num_new_blocks(request_id, num_tokens) <= self.pool.num_free_blocks

    def append(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow a request's table to hold ``num_tokens`` tokens; return the added ids."""
        needed = self.num_new_blocks(request_id, num_tokens)
        new_block_ids = self.pool.allocate(needed)
        if new_block_ids is None:
            return None
        self.block_tables[request_id].extend(new_block_ids)
        return new_block_ids

    def can_swap_out(self, request_id: str) -> bool:
        """Whether the host pool can take all of the request's blocks."""
        needed = len(self.block_tables[request_id])
        return self.host_pool is not None and needed <= self.host_pool.num_free_blocks

    def swap_out(self, request_id: str) -> list[tuple[int, int]] | None:
        """Move the request's table to host blocks; returns (device, host) pairs to copy
        before the freed device blocks are reused."""
        if not self.can_swap_out(request_id):
            return None
        device_ids = self.block_tables.pop(request_id)
        host_ids = self.host_pool.allocate(len(device_ids))
        self.pool.decref(device_ids)
        self.host_block_tables[request_id] = host_ids
        return list(zip(device_ids, host_ids))

    def can_swap_in(self, request_id: str, keep_watermark: bool = True) -> bool:
        needed = len(self.host_block_tables[request_id])
        reserve = self.watermark_blocks if keep_watermark else 0
        return needed + reserve <= self.pool.num_free_blocks

    def swap_in(self, request_id: str, keep_watermark: bool = True) -> list[tuple[int, int]] | None:
        """Bring a swapped request back to device blocks; returns (host, device) pairs."""
        if not self.can_swap_in(request_id, keep_watermark):
            return None
        host_ids = self.host_block_tables.pop(request_id)
        device_ids = self.pool.allocate(len(host_ids))
        self.host_pool.decref(host_ids)
        self.block_tables[request_id] = device_ids
        return list(zip(host_ids, device_ids))

    def free(self, request_id: str) -> None:
        """Return every block of the request, device and host (no-op without a table)."""
        block_ids = self.block_tables.pop(request_id, None)
        if block_ids:
            self.pool.decref(block_ids)
        host_ids = self.host_block_tables.pop(request_id, None)
        if host_ids:
            self.host_pool.decref(host_ids)

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if tables and pools disagree (see ``BlockPool``)."""
        self.pool.check_integrity(_holders(self.block_tables))
        if self.host_pool is not None:
            self.host_pool.check_integrity(_holders(self.host_block_tables))
        elif self.host_block_tables:
            raise AssertionError("host block tables exist without a host pool")


def _holders(tables: dict[str, list[int]]) -> dict[int, int]:
    holders: Counter[int] = Counter()
    for block_ids in tables.values():
        holders.update(block_ids)
    return dict(holders)
