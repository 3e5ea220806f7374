"""Automatic prefix caching: which physical block holds which full block of tokens."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

# The hash chain starts from this value for the first block of every request.
ROOT_HASH = 0


@dataclass(frozen=True)
class PrefixKey:
    """Whose K/V a cached prefix is: the same tokens give other K/V through another LoRA
    adapter (``lora_id``, 0: the base model) or in another rotation epoch (``rotation_epoch``:
    LongRoPE's long factors), and a client's ``salt`` (cache_salt, cache_namespace) keeps
    its prefixes to requests of the same salt."""

    lora_id: int = 0
    salt: str | None = None
    rotation_epoch: int = 0


def block_hash(parent_hash: int, token_ids: Sequence[int], namespace: Hashable | None) -> int:
    """Key of a full block: it covers the whole prefix through the parent's hash, and the
    namespace (a ``PrefixKey``) keeps K/V that must not be shared apart."""
    return hash((parent_hash, tuple(token_ids), namespace))


class PrefixCache:
    """Maps block hashes to the device blocks holding those tokens' K/V.

    A full block is registered once its tokens are all computed; it stays findable while
    a request holds it and after, while it waits in the pool's free queue, until the pool
    hands it out again (``evict``). A hit compares the stored tokens, so a hash
    collision can never serve another prefix's K/V::

        request tokens:  [ b0 | b1 | b2 | partial ]
        hash chain:        h0 ->h1 ->h2              h_i = hash(h_{i-1}, tokens_i, ns)
        cache:           h0 -> block 7, h1 -> block 2, h2 -> (miss: stop here)
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._block_by_hash: dict[int, int] = {}
        self._entry_of_block: dict[int, tuple[int, tuple[int, ...], str | None]] = {}
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    def __len__(self) -> int:
        return len(self._block_by_hash)

    def lookup(
        self, token_ids: Sequence[int], namespace: Hashable | None, max_tokens: int
    ) -> tuple[list[int], list[int]]:
        """Longest cached prefix of ``token_ids`` in full blocks, covering at most
        ``max_tokens`` tokens. Returns its block ids and their hashes."""
        block_size = self.block_size
        block_ids: list[int] = []
        hashes: list[int] = []
        parent = ROOT_HASH
        for start in range(0, max_tokens - block_size + 1, block_size):
            tokens = tuple(token_ids[start : start + block_size])
            key = block_hash(parent, tokens, namespace)
            block_id = self._block_by_hash.get(key)
            if block_id is None or self._entry_of_block[block_id][1:] != (
                tokens,
                namespace,
            ):
                break
            block_ids.append(block_id)
            hashes.append(key)
            parent = key
        return block_ids, hashes

    def record_query(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (a request may be looked up several
        times while it waits for blocks; only the lookup it is admitted with counts)."""
        self.num_queried_tokens += num_queried_tokens
        self.num_hit_tokens += num_hit_tokens

    def insert(
        self,
        key: int,
        block_id: int,
        token_ids: tuple[int, ...],
        namespace: Hashable | None,
    ) -> None:
        """Register a full, computed block. A prefix already cached in another block
        keeps that block: the newcomer is simply not findable."""
        if key in self._block_by_hash or block_id in self._entry_of_block:
            return
        self._block_by_hash[key] = block_id
        self._entry_of_block[block_id] = (key, token_ids, namespace)

    def evict(self, block_id: int) -> None:
        """The pool is reusing ``block_id`` for new tokens: forget what it held."""
        entry = self._entry_of_block.pop(block_id, None)
        if entry is not None:
            del self._block_by_hash[entry[0]]

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._entry_of_block

    def reset(self) -> None:
        self._block_by_hash.clear()
        self._entry_of_block.clear()
