"""Prefix-cache affinity for the prefill and colocated pools (torch-free).

A prefill (or colocated) replica keeps the K/V of the prompts it computed in its prefix cache (engine/
block_manager.py: full blocks keyed by chained hashes of their tokens) until the blocks are
handed out again. A prompt that shares a long prefix with an earlier one (a system prompt, the
previous turns of a conversation) is computed much faster on the replica that computed that
prefix. The router cannot see the replicas' caches, so it remembers where it sent what:

    record(replica, prompt)   after a prompt was routed: its full blocks' hashes -> that replica
    matches(prompt, replicas) how many leading full blocks of the prompt each replica was sent

The table is the router process's own memory of its routing, bounded by `max_blocks` entries
(least recently used go first), each naming at most OWNERS_PER_BLOCK replicas. It is a guess:
a replica may have evicted the blocks since, and another router replica keeps its own table.
`choose` weighs the saving against the load: the replica with the longest match goes first
when its estimated queued prompt tokens exceed the least loaded one's by at most
`max_imbalance_tokens`; otherwise the load ranking stands. Each decision is counted in
DECISIONS (this process's, by pool and outcome: "affinity", "imbalanced" = matched but too
loaded, "no_match"), which the router's /metrics shows.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Hashable, Sequence

from engine.block_manager import chain_hash, chain_seed

OWNERS_PER_BLOCK = 4
DECISIONS: Counter = Counter()   # (pool, decision) -> routing decisions in this process


def count_decision(pool: str, decision: str) -> None:
    """Count one routing decision. Request routers call this function rather than touch
    DECISIONS: Serve pickles a request router's module by value, which would copy the counter."""
    DECISIONS[(pool, decision)] += 1


def block_hashes(prompt: Sequence[int], block_size: int, key: tuple | None = None) -> list[int]:
    """Chained hashes of the prompt's full blocks, as the engine's prefix cache keys them (the chain
    starts from the request's SamplingParams.cache_key: a LoRA adapter's K/V is its own, a cache
    salt's prefixes are shared only with its own)."""
    hashes, prev = [], chain_seed(key)
    for start in range(0, len(prompt) - block_size + 1, block_size):
        prev = chain_hash(prev, tuple(prompt[start:start + block_size]))
        hashes.append(prev)
    return hashes


class AffinityTable:
    def __init__(self, block_size: int, max_blocks: int):
        assert block_size > 0 and max_blocks > 0
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._owners: OrderedDict[int, tuple[Hashable, ...]] = OrderedDict()  # oldest owner first

    def __len__(self) -> int:
        return len(self._owners)

    def record(self, replica: Hashable, hashes: list[int]) -> None:
        # Last block first: a prompt's leading blocks (the ones other prompts share) end up the
        # most recently used, so eviction takes the tails first.
        for h in reversed(hashes):
            owners = self._owners.pop(h, ())
            self._owners[h] = tuple(o for o in owners if o != replica)[1 - OWNERS_PER_BLOCK:] + (replica,)
        while len(self._owners) > self.max_blocks:
            self._owners.popitem(last=False)

    def matches(self, hashes: list[int], replicas: Sequence[Hashable]) -> dict[Hashable, int]:
        """Leading full blocks of the prompt recorded for each of `replicas` (absent: none)."""
        alive, run = set(replicas), {}
        for i, h in enumerate(hashes):
            owners = self._owners.get(h)
            alive = alive.intersection(owners) if owners else set()
            if not alive:
                break
            for r in alive:
                run[r] = i + 1
        return run

    def forget(self, replica: Hashable) -> None:
        """A replica left: drop it from every entry (entries left with no owner go)."""
        for h in [h for h, owners in self._owners.items() if replica in owners]:
            owners = tuple(o for o in self._owners[h] if o != replica)
            if owners:
                self._owners[h] = owners
            else:
                del self._owners[h]


@dataclass(frozen=True)
class Candidate:
    replica: Hashable
    load_tokens: float     # estimated prompt tokens queued on it (stats plus this router's in flight)
    rank_key: tuple        # the plain load ranking, lower first


def choose(candidates: list[Candidate], matched_blocks: dict[Hashable, int],
           max_imbalance_tokens: int, credit_per_block: int = 0) -> tuple[list[Hashable], str]:
    """All candidates, best first: the load ranking, with the longest prefix match moved to the
    front when its load is within `max_imbalance_tokens` of the least loaded candidate's (plus
    `credit_per_block` tokens for each matched block: a decode replica's load counts the K/V it
    holds, and matched blocks are K/V the request shares there instead of adding); and the
    decision ("affinity", "imbalanced" or "no_match")."""
    ranked = sorted(candidates, key=lambda c: c.rank_key)
    matched = [c for c in ranked if matched_blocks.get(c.replica, 0) > 0]
    if not matched:
        return [c.replica for c in ranked], "no_match"
    least = min(c.load_tokens for c in ranked)
    eligible = [c for c in matched
                if c.load_tokens - least <= max_imbalance_tokens + credit_per_block * matched_blocks[c.replica]]
    if not eligible:
        return [c.replica for c in ranked], "imbalanced"
    best = max(eligible, key=lambda c: matched_blocks[c.replica])   # ties: the better ranked
    ranked.remove(best)
    return [best.replica] + [c.replica for c in ranked], "affinity"
