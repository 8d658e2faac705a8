"""Custom Serve request routers for the pools.

Both rank every candidate replica (best first) from the stats the replicas publish with
`record_routing_stats`, corrected by the requests this router has in flight on each replica
(published stats are up to `request_routing_stats_period_s` old):
  * decode:  most free KV blocks (as a fraction of the pool), then fewest running sequences;
  * prefill: fewest queued prompt tokens;
  * colocated: as decode.
All three add prefix-cache affinity: the replica this router already sent the longest prefix of
the prompt to goes first while its load is close enough to the least loaded one's
(router/prefix_affinity.py; a decode replica's load is the KV it holds, in tokens).
Serve then sends to the first replica of the ranking that has room. Serve's request-router API is
reached only through serving/ray_compat.py.
"""

from __future__ import annotations

import random
from typing import List, Optional

from router.prefix_affinity import AffinityTable, Candidate, block_hashes, choose, count_decision
from serving import messages
from serving.ray_compat import FIFOMixin, PendingRequest, RequestRouter, RunningReplica, back_off_when_full, in_flight


class _RankingRouter(FIFOMixin, RequestRouter):
    def _in_flight(self, replica: RunningReplica) -> int:
        return in_flight(self, replica)

    def score(self, replica: RunningReplica) -> tuple:
        raise NotImplementedError

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if pending_request is not None:
            back_off_when_full(pending_request)
        ranked = sorted(candidate_replicas, key=lambda r: (self.score(r), random.random()))
        return [[r] for r in ranked]


def free_kv_score(stats: dict, in_flight: int, max_ongoing: int) -> tuple:
    """Lower is better: less free KV (fraction) and more load rank later."""
    total = max(stats.get("kv_blocks_total") or 1, 1)
    free_fraction = stats.get("kv_blocks_free", total) / total
    return (-(free_fraction - in_flight / max(max_ongoing, 1)), stats.get("running", 0) + in_flight)


def queued_tokens_score(stats: dict, in_flight: int) -> tuple:
    return (stats.get("waiting_prompt_tokens", 0), in_flight)


class FreeKVBlocksRouter(_RankingRouter):
    """The replica with the most free KV blocks first."""

    def score(self, replica: RunningReplica) -> tuple:
        return free_kv_score(replica.routing_stats or {}, self._in_flight(replica), replica.max_ongoing_requests)


class _PrefixAffinity:
    """Prefix-cache affinity on top of a ranking router (router/prefix_affinity.py): the replica
    this router already sent the longest prefix of the prompt to goes first while its estimated
    queued prompt tokens are within `max_imbalance_tokens` of the least loaded one's. The request
    router kwargs come from AppConfig.routing; `REQUEST` is the message type the pool receives."""

    REQUEST: type = messages.PrefillRequest
    POOL = "prefill"
    SHARES_MATCH = False     # the load counts KV held, which a match shares: credit it (decode)

    def initialize_state(self, block_size: int = 16, prefix_affinity: bool = True,
                         max_imbalance_tokens: int = 2048, max_blocks: int = 200_000, **_):
        self._table = AffinityTable(block_size, max_blocks) if prefix_affinity else None
        self._max_imbalance_tokens = max_imbalance_tokens
        self._mean_prompt_tokens = 0.0   # running mean, to turn requests in flight into tokens

    def _prompt(self, pending_request: Optional[PendingRequest]) -> tuple[tuple[int, ...], tuple | None] | None:
        """The tokens the replica computes (and then caches): the prompt, and a resumed request's
        output tokens after it; and their cache key, SamplingParams.cache_key (a LoRA adapter's K/V is
        its own, a cache salt's prefixes are shared only with its own)."""
        if getattr(self, "_table", None) is None or pending_request is None or not pending_request.args:
            return None
        try:
            req = messages.decode(pending_request.args[0], expect=self.REQUEST)
        except messages.MessageError:
            return None
        return req.prompt_token_ids + req.resumed_token_ids, req.params.cache_key

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        prompt, key = self._prompt(pending_request) or ((), None)
        if not prompt:
            return await super().choose_replicas(candidate_replicas, pending_request)
        back_off_when_full(pending_request)
        matched = self._table.matches(block_hashes(prompt, self._table.block_size, key),
                                      [r.replica_id for r in candidate_replicas])
        candidates = [Candidate(r.replica_id, self._load_tokens(r), (self.score(r), random.random()))
                      for r in candidate_replicas]
        order, decision = choose(candidates, matched, self._max_imbalance_tokens,
                                 self._table.block_size if self.SHARES_MATCH else 0)
        count_decision(self.POOL, decision)
        by_id = {r.replica_id: r for r in candidate_replicas}
        return [[by_id[i]] for i in order]

    def _load_tokens(self, replica: RunningReplica) -> float:
        stats = replica.routing_stats or {}
        return stats.get("waiting_prompt_tokens", 0) + self._in_flight(replica) * self._mean_prompt_tokens

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        prompt, key = self._prompt(pending_request) or ((), None)
        if prompt:
            self._mean_prompt_tokens += (len(prompt) - self._mean_prompt_tokens) * 0.05
            self._table.record(replica_id, block_hashes(prompt, self._table.block_size, key))

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        if getattr(self, "_table", None) is not None:
            self._table.forget(replica_id)


class QueuedPromptTokensRouter(_PrefixAffinity, _RankingRouter):
    """Prefill pool: the replica with the fewest queued prompt tokens first, with prefix-cache
    affinity."""

    REQUEST, POOL = messages.PrefillRequest, "prefill"

    def score(self, replica: RunningReplica) -> tuple:
        return queued_tokens_score(replica.routing_stats or {}, self._in_flight(replica))


class ColocatedRouter(_PrefixAffinity, FreeKVBlocksRouter):
    """Colocated pool: the decode ranking (most free KV blocks first), with prefix-cache affinity
    (its engines cache prompts like prefill engines do)."""

    REQUEST, POOL = messages.GenerateRequest, "colocated"


class DecodeRouter(_PrefixAffinity, FreeKVBlocksRouter):
    """Decode pool: the decode ranking (most free KV blocks first), with prefix-cache affinity: a
    decode replica keeps the K/V it received and decoded in its prefix cache, and the prefill
    replica does not push the leading blocks it still holds (decode_service/server.py step 1),
    so a conversation's next turn (or a prompt sharing a long prefix) goes back to it while its
    load allows. The load is KV held, in tokens (used blocks), plus this router's requests in
    flight there at the mean prompt length; the threshold is `decode_max_imbalance_tokens`
    (AppConfig.routing), which pdserve/app_builder.py passes as `max_imbalance_tokens`, plus the
    matched tokens: K/V the request would share there, not add (so the other choices of an
    `n > 1` request follow the first to the replica that holds its prompt, however long)."""

    REQUEST, POOL, SHARES_MATCH = messages.DecodeRequest, "decode", True

    def _load_tokens(self, replica: RunningReplica) -> float:
        stats = replica.routing_stats or {}
        used = max(stats.get("kv_blocks_total", 0) - stats.get("kv_blocks_free", 0), 0)
        return used * self._table.block_size + self._in_flight(replica) * self._mean_prompt_tokens
