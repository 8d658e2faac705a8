"""Paged KV-cache bookkeeping: block allocation, ref counts, prefix caching (torch-free).

Ownership contract
------------------
* A block with ``ref_count > 0`` belongs to the sequences (or reservations) that hold it;
  only `free`/`release` give it back. Every path that ends a request (finish, abort,
  preemption, failed transfer, timeout) must call one of them exactly once.
* A free block may still carry a prefix hash: it stays findable by `allocate` until it is
  handed out again (least recently freed first), so "free" includes "cached but unused".
* `reserve` hands out fresh blocks for an incoming KV transfer, `reserve_cached` the cached
  blocks that already hold its leading full blocks (the decode role: they are not sent again)
  and fresh ones for the rest; the caller owns them until it `adopt`s them into a sequence or
  `release`s them.
* A model whose every layer attends a sliding window (`window` W > 0: Mistral v0.1, Phi-3-mini-4k)
  needs no key more than W - 1 positions before the query: once a sequence's next query is past
  a block's last key by W, `mark_computed` gives the block back (vLLM frees such blocks too). The
  table keeps its entry (`Sequence.num_released_blocks` counts them, always the leading ones):
  a stale id that attention never weighs (the kernels start at the window's first key; the torch
  paths mask it), and `free` drops only the blocks after them. A prefill-role sequence
  (`hold_blocks`) keeps all its blocks: they are exported whole.
Only the engine thread calls into a `BlockManager`; it is not thread-safe.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: tuple[int, ...] = ()


def chain_hash(prev_hash: int, token_ids: tuple[int, ...]) -> int:
    """Hash of a full block given the hash of the block before it (for the first, its chain's
    `chain_seed`)."""
    return hash((prev_hash, token_ids))


def chain_seed(key: tuple | None) -> int:
    """Where a sequence's chain of block hashes starts: -1 for the base model, unsalted; else from
    its SamplingParams.cache_key, (LoRA adapter's key, cache salt): an adapter's K/V differs from the
    base model's for the same tokens (its key: its name, and for one loaded at run time its load
    id), and a salted request shares cached blocks only with requests of the same salt."""
    if key is None:
        return -1
    lora, salt = key
    name, lora_id = lora or ("", 0)
    text = (name if not lora_id else f"{name}\0{lora_id}") + ("" if salt is None else f"\0\0{salt}")
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, window: int = 0):
        """`window`: 0, or W when every layer attends only its last W keys (the largest window
        of the model's layers; see the contract above)."""
        assert num_blocks > 0 and block_size > 0 and window >= 0
        self.block_size = block_size
        self.window = window
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._hash_to_block: dict[int, int] = {}
        self.prefix_hits = 0      # tokens served from the prefix cache, for metrics
        self.prefix_queries = 0   # prompt tokens looked up

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def all_free(self) -> bool:
        return len(self._free) == self.num_blocks

    # ---- allocation for a sequence ------------------------------------------------------
    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks matching the sequence's leading full blocks; at least one token
        is always left to compute so the step can produce logits. None for a request that wants
        prompt logprobs or pools every token (SamplingParams.whole_prompt): every prompt position
        must be computed."""
        if seq.params.whole_prompt:
            return []
        return self._cached(seq.token_ids, seq.params.cache_key)

    def _cached(self, token_ids, key: tuple | None) -> list[int]:
        """Cached blocks holding the K/V of the leading full blocks of `token_ids` (of cache key
        `key`: SamplingParams.cache_key), short of the block with the last token (always left to
        compute, or to receive)."""
        if not self.enable_prefix_caching:
            return []
        hits, prev, bs = [], chain_seed(key), self.block_size
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(prev, tokens)
            block_id = self._hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
            prev = h
        return hits

    def cached_tokens(self, token_ids, key: tuple | None = None) -> int:
        """How many leading tokens of `token_ids` (of cache key `key`) the prefix cache holds
        (full blocks, short of the block with the last token); nothing changes."""
        return len(self._cached(token_ids, key)) * self.block_size

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether `allocate` would succeed now (nothing changes)."""
        return self._fits(self._prefix_hits(seq), self.blocks_for(len(seq)))

    def can_reserve(self, token_ids, key: tuple | None = None) -> bool:
        """Whether `reserve_cached` would succeed now (nothing changes)."""
        return self._fits(self._cached(token_ids, key), self.blocks_for(len(token_ids)))

    def allocate(self, seq: Sequence) -> bool:
        """Give a waiting sequence blocks for all its tokens, reusing cached prefix blocks.

        Returns False (and changes nothing) when there are not enough free blocks.
        """
        assert not seq.block_table
        hits = self._prefix_hits(seq)
        table = self._claim(hits, self.blocks_for(len(seq)))
        if table is None:
            return False
        seq.block_table = table
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        seq.block_hashes = [self.blocks[b].hash for b in hits]
        self.prefix_queries += len(seq)
        self.prefix_hits += seq.num_cached_tokens
        return True

    def append_slots(self, seq: Sequence) -> bool:
        """Make room for every token of a running sequence; False when out of blocks."""
        while len(seq.block_table) * self.block_size < len(seq):
            if not self._free:
                return False
            seq.block_table.append(self._take_fresh())
        return True

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's hold on its blocks (those not given back already as they left the
        window). Called exactly once per allocation."""
        self.release(reversed(seq.block_table[seq.num_released_blocks:]))
        seq.block_table = []
        seq.num_released_blocks = 0
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def mark_computed(self, seq: Sequence) -> None:
        """The sequence's K/V is computed up to `num_computed_tokens`: register every full block in
        the prefix cache, then (a sliding-window model) give back the blocks its next query's window
        has passed. The engine calls it whenever `num_computed_tokens` grows."""
        if self.enable_prefix_caching:
            self._register(seq)
        if self.window and not seq.hold_blocks:
            self._slide(seq)

    def _register(self, seq: Sequence) -> None:
        bs = self.block_size
        while (len(seq.block_hashes) + 1) * bs <= seq.num_computed_tokens:
            i = len(seq.block_hashes)
            tokens = tuple(seq.block_tokens(i, bs))
            h = chain_hash(seq.block_hashes[-1] if i else chain_seed(seq.params.cache_key), tokens)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if h not in self._hash_to_block and block.hash == -1:
                block.hash, block.token_ids = h, tokens
                self._hash_to_block[h] = block.block_id

    def _slide(self, seq: Sequence) -> None:
        """Release the leading blocks wholly before the window of the next query (position
        `num_computed_tokens`, whose first key is `num_computed_tokens + 1 - window`). Registered
        first (`mark_computed`), so a released block stays findable in the prefix cache until it is
        handed out again."""
        passed = max(0, seq.num_computed_tokens + 1 - self.window) // self.block_size
        if passed > seq.num_released_blocks:
            self.release(seq.block_table[seq.num_released_blocks:passed])
            seq.num_released_blocks = passed

    # ---- reservations for incoming KV ---------------------------------------------------
    def reserve(self, num_tokens: int) -> list[int] | None:
        """Fresh blocks for `num_tokens` tokens of incoming KV, or None if not enough."""
        n = self.blocks_for(num_tokens)
        if n > self.num_free_blocks:
            return None
        return [self._take_fresh() for _ in range(n)]

    def reserve_cached(self, token_ids, key: tuple | None = None) -> tuple[list[int], int] | None:
        """Blocks for the K/V of `token_ids` (of cache key `key`: SamplingParams.cache_key), the leading ones
        taken from the prefix cache where it holds them: (block ids, how many of them are cached).
        Only the rest is to be received; the block with the last token always is. The caller owns
        every block (one reference each, a cached block perhaps shared with running sequences)
        until it `adopt`s them or `release`s them all. None (nothing changed) if not enough blocks
        are free."""
        hits = self._cached(token_ids, key)
        table = self._claim(hits, self.blocks_for(len(token_ids)))
        return None if table is None else (table, len(hits))

    def adopt(self, seq: Sequence, block_ids: list[int], num_computed: int) -> None:
        """Hand reserved blocks (now holding K/V for `num_computed` tokens) to a sequence."""
        assert not seq.block_table and len(block_ids) == self.blocks_for(num_computed)
        seq.block_table = list(block_ids)
        seq.num_computed_tokens = num_computed
        seq.block_hashes = []
        self.mark_computed(seq)

    def release(self, block_ids) -> None:
        """Drop one reference to each block (a reservation or a sequence's table)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    # ---- internals ------------------------------------------------------------------------
    def _claim(self, hits: list[int], num_blocks: int) -> list[int] | None:
        """A table of `num_blocks`: the cached `hits` (one more reference each), then fresh
        blocks; None (nothing changed) when too few are free."""
        if not self._fits(hits, num_blocks):
            return None
        for block_id in hits:
            self._ref(block_id)
        return hits + [self._take_fresh() for _ in range(num_blocks - len(hits))]

    def _fits(self, hits: list[int], num_blocks: int) -> bool:
        """Whether a table of `num_blocks` starting with the cached `hits` can be claimed: the
        fresh blocks come from the free ones but the hits that are free themselves (revived)."""
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return num_blocks - len(hits) <= self.num_free_blocks - revived

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _take_fresh(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if block.hash != -1:
            if self._hash_to_block.get(block.hash) == block_id:
                del self._hash_to_block[block.hash]
            block.hash, block.token_ids = -1, ()
        block.ref_count = 1
        return block_id
