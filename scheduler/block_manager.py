"""Block tables: which physical blocks hold each request's KV cache."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable

from pagedserve.scheduler.block_pool import BlockPool
from pagedserve.scheduler.messages import NULL_BLOCK
from pagedserve.scheduler.prefix_cache import ROOT_HASH, PrefixCache, block_hash


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def blocks_spanned(num_tokens: int, block_size: int) -> int:
    """The most blocks ``num_tokens`` consecutive positions can touch, wherever they start
    (one more than ``blocks_for_tokens`` when they may straddle a block boundary)."""
    return blocks_for_tokens(num_tokens - 1, block_size) + 1 if num_tokens > 0 else 0


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

    With prefix caching, full computed blocks are registered in a ``PrefixCache``; a new
    request starts its table with the longest cached prefix (ref counts go up, nothing
    is copied) and computes only the rest.

    With a ``sliding_window`` (tokens; every layer of the model attends to at most that many
    positions back from each query), a block that lies wholly before the window of a
    request's next query token is never read again: ``free_blocks_before_window`` gives it
    back and its entry becomes ``NULL_BLOCK``, keeping the others in place::

        window 20 tokens, next query at position 41: it reads positions 22..41
        tokens   0..15 | 16..31 | 32..47
        table    [ -1  ,    2   ,    9 ]      block 7 returned to the pool

    So a long sequence holds about ``sliding_window`` tokens of blocks, however long it
    grows. The freed entries are always a prefix of the table (``num_window_freed``).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        watermark_blocks: int = 0,
        num_host_blocks: int = 0,
        enable_prefix_caching: bool = False,
        allocation_policy: str = "paged",
        sliding_window: int = 0,
    ) -> None:
        if block_size not in (8, 16, 32):
            raise ValueError(f"block_size must be one of 8, 16, 32 (tokens), got {block_size}")
        self.block_size = block_size
        # "paged" takes any free blocks on demand; the baselines reserve one contiguous
        # run of block ids at admission (see SchedulerConfig.allocation_policy).
        self.contiguous = allocation_policy != "paged"
        self.allocation_policy = allocation_policy
        if self.contiguous and enable_prefix_caching:
            raise ValueError(
                f"allocation_policy {allocation_policy!r} reserves contiguous slots and "
                "shares nothing; prefix caching needs allocation_policy 'paged'"
            )
        self.pool = BlockPool(num_blocks)
        self.host_pool = BlockPool(num_host_blocks) if num_host_blocks > 0 else None
        # Admissions keep this many blocks spare so a newly admitted request does not
        # force a running one out on its very next step.
        self.watermark_blocks = watermark_blocks
        self.block_tables: dict[str, list[int]] = {}
        self.host_block_tables: dict[str, list[int]] = {}
        self.prefix_cache = PrefixCache(block_size) if enable_prefix_caching else None
        if self.prefix_cache is not None:
            self.pool.on_evict = self.prefix_cache.evict
        # Hash chain of each request's registered full blocks.
        self._block_hashes: dict[str, list[int]] = {}
        # A contiguous reservation is held whole to the end, as the baselines did.
        self.sliding_window = 0 if self.contiguous else sliding_window
        # Leading NULL_BLOCK entries of each table (device or host) that has any.
        self._num_window_freed: dict[str, int] = {}

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

    def num_window_freed(self, request_id: str) -> int:
        """Leading entries of the request's table given back (``NULL_BLOCK``)."""
        return self._num_window_freed.get(request_id, 0)

    def num_held_blocks(self, request_id: str) -> int:
        """Device blocks the request's table holds (its entries but the freed ones)."""
        table = self.block_tables.get(request_id, ())
        return len(table) - self.num_window_freed(request_id) if table else 0

    def first_needed_block(self, num_computed_tokens: int) -> int:
        """Index of the first table entry that the query token at position
        ``num_computed_tokens``, or any later one, reads; 0 without a sliding window."""
        if not self.sliding_window:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def free_blocks_before_window(self, request_id: str, num_computed_tokens: int) -> int:
        """Give back the request's blocks that lie wholly before the window of its next
        query token (at position ``num_computed_tokens``); their entries become
        ``NULL_BLOCK``. Returns the table's new count of freed entries when this call freed
        any, else 0."""
        first_needed = self.first_needed_block(num_computed_tokens)
        already = self._num_window_freed.get(request_id, 0)
        table = self.block_tables[request_id]
        first_needed = min(first_needed, len(table))
        if first_needed <= already:
            return 0
        freed = table[already:first_needed]
        table[already:first_needed] = [NULL_BLOCK] * len(freed)
        self._num_window_freed[request_id] = first_needed
        # Latest first, as ``free`` does: a cached prefix's head stays cached longest.
        self.pool.decref(freed[::-1])
        return first_needed

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks a request must gain so that ``num_tokens`` tokens have a slot."""
        held = len(self.block_tables.get(request_id, ()))
        return max(0, blocks_for_tokens(num_tokens, self.block_size) - held)

    def find_cached_prefix(
        self,
        token_ids: list[int],
        namespace: Hashable | None = None,
        max_cached_tokens: int | None = None,
    ) -> list[int]:
        """Block ids of the longest cached prefix of ``token_ids`` in full blocks, of at most
        ``max_cached_tokens`` tokens. The last token is always left to compute, so its logits
        exist to sample from."""
        if self.prefix_cache is None:
            return []
        max_tokens = len(token_ids) - 1
        if max_cached_tokens is not None:
            max_tokens = min(max_tokens, max_cached_tokens)
        block_ids, _ = self.prefix_cache.lookup(token_ids, namespace, max_tokens)
        return block_ids

    def reservation_tokens(
        self, num_prompt_tokens: int, max_tokens: int, max_model_len: int
    ) -> int:
        """Slots a contiguous policy reserves for a request at admission (the paper's
        baselines): max_model_len (``max``), the prompt and ``max_tokens`` rounded up to a
        power of two (``pow2``), or the prompt and ``max_tokens`` (``oracle``); 0 when paged."""
        policy = self.allocation_policy
        if policy == "paged":
            return 0
        if policy == "max":
            return max_model_len
        if policy == "pow2":
            max_tokens = 1 << (max_tokens - 1).bit_length()
        return min(num_prompt_tokens + max_tokens, max_model_len)

    def can_allocate(
        self,
        num_tokens: int,
        keep_watermark: bool = True,
        cached_block_ids: list[int] = (),
        reserve_tokens: int = 0,
    ) -> bool:
        """Whether a new request could get slots for ``num_tokens`` tokens, its first
        blocks being ``cached_block_ids`` (prefix hits, possibly free-but-cached).

        With ``keep_watermark`` the pool must keep ``watermark_blocks`` spare afterwards;
        the caller drops it when nothing is running, since the watermark only protects
        running requests and would otherwise block a request that fits the cache.
        Contiguous policies need one free run of ``reserve_tokens`` (at least
        ``num_tokens``) slots.
        """
        if self.contiguous:
            needed = blocks_for_tokens(max(num_tokens, reserve_tokens), self.block_size)
            return needed <= self.pool.largest_free_run()
        reserve = self.watermark_blocks if keep_watermark else 0
        return self.blocks_to_allocate(num_tokens, cached_block_ids) + reserve <= (
            self.pool.num_free_blocks
        )

    def blocks_to_allocate(self, num_tokens: int, cached_block_ids: list[int] = ()) -> int:
        """Free blocks that ``allocate`` (paged) takes for a new request of ``num_tokens``
        tokens whose first blocks are the cached ``cached_block_ids``."""
        needed = blocks_for_tokens(num_tokens, self.block_size) - len(cached_block_ids)
        # A hit on a free cached block takes that block off the free queue too; hits
        # before the window of the first token to compute are not taken at all.
        skipped = self._num_cached_skipped(cached_block_ids)
        return needed + sum(
            1 for block_id in cached_block_ids[skipped:] if self.pool.is_free(block_id)
        )

    def _num_cached_skipped(self, cached_block_ids: list[int]) -> int:
        """Leading prefix hits wholly before the window of the first token computed after
        them: the new request's table holds ``NULL_BLOCK`` there."""
        return self.first_needed_block(len(cached_block_ids) * self.block_size)

    def allocate(
        self,
        request_id: str,
        num_tokens: int,
        keep_watermark: bool = True,
        cached_block_ids: list[int] = (),
        reserve_tokens: int = 0,
    ) -> list[int] | None:
        """Create the block table of a new request with room for ``num_tokens`` tokens,
        starting with the shared ``cached_block_ids``. Under a contiguous policy the
        table is the whole reservation of ``reserve_tokens`` slots from the start."""
        if request_id in self.block_tables:
            raise RuntimeError(f"request {request_id!r} already has a block table")
        if self.contiguous:
            needed = blocks_for_tokens(max(num_tokens, reserve_tokens), self.block_size)
            block_ids = self.pool.allocate_contiguous(needed)
            if block_ids is None:
                return None
            self.block_tables[request_id] = block_ids
            return list(block_ids)
        if not self.can_allocate(num_tokens, keep_watermark, cached_block_ids):
            return None
        skipped = self._num_cached_skipped(cached_block_ids)
        for block_id in cached_block_ids[skipped:]:
            if self.pool.is_free(block_id):
                self.pool.revive(block_id)
            else:
                self.pool.incref([block_id])
        new_block_ids = self.pool.allocate(
            blocks_for_tokens(num_tokens, self.block_size) - len(cached_block_ids)
        )
        assert new_block_ids is not None
        block_ids = [
            *([NULL_BLOCK] * skipped),
            *cached_block_ids[skipped:],
            *new_block_ids,
        ]
        self.block_tables[request_id] = block_ids
        if skipped:
            self._num_window_freed[request_id] = skipped
        return list(block_ids)

    def cache_full_blocks(
        self,
        request_id: str,
        token_ids: list[int],
        num_computed_tokens: int,
        namespace: Hashable | None = None,
    ) -> None:
        """Register the request's blocks that are now full and computed (a prefix hit's
        blocks hash to entries already there, which stay as they are). Computed tokens not
        yet in ``token_ids`` (a speculating sequence's accepted drafts, appended after) wait
        for the next call: a block is hashed only when all its tokens are known."""
        if self.prefix_cache is None or request_id not in self.block_tables:
            return
        hashes = self._block_hashes.setdefault(request_id, [])
        num_known = min(num_computed_tokens, len(token_ids))
        num_full = min(num_known // self.block_size, len(self.block_tables[request_id]))
        block_size = self.block_size
        table = self.block_tables[request_id]
        for index in range(len(hashes), num_full):
            tokens = tuple(token_ids[index * block_size : (index + 1) * block_size])
            parent = hashes[-1] if hashes else ROOT_HASH
            key = block_hash(parent, tokens, namespace)
            # A block freed before it was registered (its window passed first) only links
            # the chain: the later blocks' hashes still depend on its tokens.
            if table[index] != NULL_BLOCK:
                self.prefix_cache.insert(key, table[index], tokens, namespace)
            hashes.append(key)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix; blocks in use keep their contents."""
        if self.prefix_cache is not None:
            self.prefix_cache.reset()
            self._block_hashes.clear()

    def fork(self, parent_id: str, child_id: str) -> list[int]:
        """Give ``child_id`` the parent's table, sharing every block (ref counts go up,
        nothing is copied until one of them writes into a shared block)."""
        if child_id in self.block_tables:
            raise RuntimeError(f"request {child_id!r} already has a block table")
        block_ids = list(self.block_tables[parent_id])
        self.pool.incref(_held(block_ids))
        self.block_tables[child_id] = block_ids
        if parent_id in self._block_hashes:
            self._block_hashes[child_id] = list(self._block_hashes[parent_id])
        if parent_id in self._num_window_freed:
            self._num_window_freed[child_id] = self._num_window_freed[parent_id]
        return list(block_ids)

    def decode_growth(self, request_id: str, num_computed_tokens: int) -> int | None:
        """For a request whose next token goes at position ``num_computed_tokens``: the
        blocks its table must gain (0 or 1), or None when that token's block is shared
        (``needs_copy_on_write``). One lookup for the two questions a decode asks."""
        table = self.block_tables[request_id]
        block_size = self.block_size
        index = num_computed_tokens // block_size
        if index >= len(table):
            return index + 1 - len(table)
        if num_computed_tokens % block_size and self.pool.ref_count(table[index]) > 1:
            return None
        return 0

    def needs_copy_on_write(self, request_id: str, num_computed_tokens: int) -> bool:
        """Whether the block that the request's next token goes into already holds
        tokens and is shared with another sequence, so it must be copied first."""
        if num_computed_tokens % self.block_size == 0:
            return False  # the next token starts a fresh block
        table = self.block_tables[request_id]
        index = num_computed_tokens // self.block_size
        return index < len(table) and self.pool.ref_count(table[index]) > 1

    def copy_on_write(self, request_id: str, num_computed_tokens: int) -> tuple[int, int] | None:
        """Give the request a private copy of the shared block its next token goes
        into; returns the (source, destination) pair the workers must copy before the
        step writes, or ``None`` when no copy is needed or no block is free."""
        if not self.needs_copy_on_write(request_id, num_computed_tokens):
            return None
        new_block_ids = self.pool.allocate(1)
        if new_block_ids is None:
            return None
        table = self.block_tables[request_id]
        index = num_computed_tokens // self.block_size
        source = table[index]
        table[index] = new_block_ids[0]
        self.pool.decref([source])
        return source, new_block_ids[0]

    def undo_copy_on_write(
        self, request_id: str, index: int, source: int, destination: int
    ) -> None:
        """Take back a ``copy_on_write`` whose copy will not run (its sequence was
        preempted in the same step): the table points at the shared source again."""
        table = self.block_tables[request_id]
        if table[index] != destination:
            raise RuntimeError(f"block {destination} is not at index {index} of {request_id!r}")
        self.pool.incref([source])
        table[index] = source
        self.pool.decref([destination])

    def can_append(self, request_id: str, num_tokens: int, num_computed_tokens: int = 0) -> bool:
        """Whether the request's table can grow to hold ``num_tokens`` tokens in all,
        counting the copy of a shared block its next token would write into."""
        needed = self.num_new_blocks(request_id, num_tokens)
        if num_computed_tokens and self.needs_copy_on_write(request_id, num_computed_tokens):
            needed += 1
        return needed <= self.pool.num_free_blocks

    def append(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow a request's table to hold ``num_tokens`` tokens; return the added ids."""
        needed = self.num_new_blocks(request_id, num_tokens)
        new_block_ids = self.pool.allocate(needed)
        if new_block_ids is None:
            return None
        self.block_tables[request_id].extend(new_block_ids)
        return new_block_ids

    def _unique_blocks(self, tables: dict[str, list[int]], request_ids: list[str]) -> list[int]:
        return list(dict.fromkeys(b for rid in request_ids for b in _held(tables[rid])))

    def can_swap_out(self, request_ids: list[str]) -> bool:
        """Whether the host pool can take all blocks of the requests (a sequence group:
        blocks they share are copied once)."""
        needed = len(self._unique_blocks(self.block_tables, request_ids))
        return self.host_pool is not None and needed <= self.host_pool.num_free_blocks

    def swap_out(self, request_ids: list[str]) -> list[tuple[int, int]] | None:
        """Move the requests' tables to host blocks, keeping what they share shared;
        returns (device, host) pairs to copy before the freed device blocks are reused."""
        if not self.can_swap_out(request_ids):
            return None
        device_ids = self._unique_blocks(self.block_tables, request_ids)
        host_ids = self.host_pool.allocate(len(device_ids))
        to_host = dict(zip(device_ids, host_ids))
        for request_id in request_ids:
            table = self.block_tables.pop(request_id)
            # Its blocks come back under new ids: their hashes are registered anew then.
            self._block_hashes.pop(request_id, None)
            self.pool.decref(_held(table))
            host_table = [to_host.get(block_id, NULL_BLOCK) for block_id in table]
            self.host_block_tables[request_id] = host_table
        # Each host block starts with one owner; the other sharers add theirs.
        self.host_pool.incref(_extra_holders(self.host_block_tables, request_ids))
        return list(to_host.items())

    def can_swap_in(
        self,
        request_ids: list[str],
        keep_watermark: bool = True,
        num_tokens: list[int] | None = None,
    ) -> bool:
        """Whether the requests' blocks fit back on the device, with room for request
        ``i`` to grow to ``num_tokens[i]`` tokens in the same step (and, for a group of
        several, to copy the shared block each one writes into next)."""
        reserve = self.watermark_blocks if keep_watermark else 0
        return self.blocks_to_swap_in(request_ids, num_tokens) + reserve <= (
            self.pool.num_free_blocks
        )

    def blocks_to_swap_in(self, request_ids: list[str], num_tokens: list[int] | None = None) -> int:
        """Free device blocks that swapping the requests in takes (see ``can_swap_in``)."""
        needed = len(self._unique_blocks(self.host_block_tables, request_ids))
        if num_tokens is not None:
            for request_id, count in zip(request_ids, num_tokens):
                held = len(self.host_block_tables[request_id])
                needed += max(0, blocks_for_tokens(count, self.block_size) - held)
            if len(request_ids) > 1:
                needed += len(request_ids)
        return needed

    def num_blocks_freed_by(self, request_ids: list[str]) -> int:
        """Device blocks that would return to the free pool if these requests gave theirs
        up (preempted, by swap or recompute): those no other request holds."""
        holders = Counter(b for rid in request_ids for b in _held(self.block_tables.get(rid, ())))
        return sum(1 for b, count in holders.items() if self.pool.ref_count(b) == count)

    def swap_in(
        self, request_ids: list[str], keep_watermark: bool = True
    ) -> list[tuple[int, int]] | None:
        """Bring swapped requests back to device blocks; returns (host, device) pairs."""
        if not self.can_swap_in(request_ids, keep_watermark):
            return None
        host_ids = self._unique_blocks(self.host_block_tables, request_ids)
        device_ids = self.pool.allocate(len(host_ids))
        to_device = dict(zip(host_ids, device_ids))
        for request_id in request_ids:
            host_table = self.host_block_tables.pop(request_id)
            self.host_pool.decref(_held(host_table))
            self.block_tables[request_id] = [
                to_device.get(block_id, NULL_BLOCK) for block_id in host_table
            ]
        self.pool.incref(_extra_holders(self.block_tables, request_ids))
        return list(to_device.items())

    def free(self, request_id: str) -> None:
        """Return every block of the request, device and host (no-op without a table)."""
        block_ids = self.block_tables.pop(request_id, None)
        self._block_hashes.pop(request_id, None)
        self._num_window_freed.pop(request_id, None)
        if block_ids:
            # Tail first: of blocks freed together, the one ending the longest prefix is
            # evicted first, and the shared head of a prefix stays cached longest.
            self.pool.decref(_held(block_ids[::-1]))
        host_ids = self.host_block_tables.pop(request_id, None)
        if host_ids:
            self.host_pool.decref(_held(host_ids))

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if tables and pools disagree (see ``BlockPool``), or a
        table's freed entries are not exactly its recorded prefix."""
        for tables in (self.block_tables, self.host_block_tables):
            for request_id, table in tables.items():
                num_freed = self._num_window_freed.get(request_id, 0)
                freed = [index for index, block_id in enumerate(table) if block_id == NULL_BLOCK]
                if freed != list(range(num_freed)):
                    raise AssertionError(
                        f"request {request_id!r}: NULL_BLOCK entries at {freed}, but its "
                        f"first {num_freed} entries are the freed ones"
                    )
        self.pool.check_integrity(_holders(self.block_tables))
        if self.host_pool is not None:
            self.host_pool.check_integrity(_holders(self.host_block_tables))
        elif self.host_block_tables:
            raise AssertionError("host block tables exist without a host pool")


def _extra_holders(tables: dict[str, list[int]], request_ids: list[str]) -> list[int]:
    """Each block once per holder beyond its first, among ``request_ids``' tables."""
    seen: set[int] = set()
    extra = []
    for request_id in request_ids:
        for block_id in _held(tables[request_id]):
            if block_id in seen:
                extra.append(block_id)
            seen.add(block_id)
    return extra


def _holders(tables: dict[str, list[int]]) -> dict[int, int]:
    holders: Counter[int] = Counter()
    for block_ids in tables.values():
        holders.update(_held(block_ids))
    return dict(holders)


def _held(block_ids: list[int]) -> list[int]:
    """The blocks a table holds: its entries but the ``NULL_BLOCK`` ones."""
    return [block_id for block_id in block_ids if block_id != NULL_BLOCK]
