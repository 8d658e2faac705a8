"""Decode replica: a Serve deployment holding an engine in the decode role.

Life cycle of a request here (`generate`, a streaming call the router makes before the prefill)
  0. place    where this replica's prefix cache holds the prompt's beginning (an earlier turn of
              the conversation decoded here, the same prompt's other choice) and the tokens it
              lacks, with the prompt tokens the replica has queued already, are at most
              `routing.local_prefill_tokens`, compute them here instead (`_local`): one engine
              call checks and queues the prompt, whose few uncached tokens run inside the decode
              steps, and TokenEvents stream from its first token, as in a colocated replica (no
              reservation, no prefill replica, no hand-off; leaving early aborts the request,
              which frees its blocks). A prompt new to the replica always goes on:
  1. reserve  blocks for the prompt's K/V (a resumed request's: and its resumed tokens') on the
              engine thread, the leading full blocks this replica's prefix cache still holds
              (an earlier turn of the conversation, a shared system prompt, the same prompt's
              other choices) taken from there, shared with any sequence using them; too few
              free (with the priority policy: after preempting running requests of a lower
              priority) -> a 503 event at once (the prefill never runs)
  2. expect   hand the blocks still to be filled to the KV receiver, then yield `Reserved` (its
              identity: the request id at this replica's KV address; and how many leading
              blocks are cached, which the prefill replica does not push), which the router
              hands to the prefill
  3. await    the push, bounded by the lease (which also covers the prefill's queue and the
              prefill); it lands in the reserved blocks with the first token (a KVHandoff) and
              this yields `Landed` (from here the prefill replica's fate does not matter: a
              router that learns the push is lost before it, its prefill replica dead or
              reporting a failed push, drops the reservation at once instead of waiting out the
              lease); a failure frees the reservation -> error event
  4. admit    `add_prefilled` with that first token, one engine call that checks the request
              first (a bad one releases the reservation -> 400 event; a request whose LoRA
              adapter loaded at run time finds max_loras in use is parked, its blocks held,
              until one is free); from here the engine owns the blocks, even when the first
              token already ends the request. A structured-output request's grammar was compiled
              meanwhile, on a worker thread, from step 1 on (`AsyncEngine.prepare`, which also
              reads a LoRA adapter loaded at run time): the engine thread only copies it
  5. stream   TokenEvents until the request finishes, at most one per `stream_interval_ms` (the
              first, which repeats the prefill's token, waits like the rest); leaving early
              (client gone, router cancelled) aborts the request in the engine, which frees its blocks
Block ownership: steps 1-3 belong to this method, which frees the reservation on every path
that does not reach step 4: an error, lease expiry, or the router leaving (client gone, the
first token ended the request, the prefill failed): the reservation is cancelled at once (a
push already writing is drained first) and freed when the receiver resolves it. From step 4 the
engine.
"""

from __future__ import annotations

import asyncio
import logging

from ray import serve

from engine.outputs import Rejected
from kv_transfer import KVReceiver, fingerprint_for
from serving import messages
from serving.config import AppConfig
from serving.engine_host import EngineHost, EngineReplica
from serving.replica_util import engine_events, error_event, kv_bind_host

log = logging.getLogger(__name__)
_LOCAL = object()        # `_reserve`'s answer for a prompt prefilled here (step 0)


@serve.deployment
class DecodeServer(EngineReplica):
    def __init__(self, config: dict, registry=None):
        cfg = AppConfig.model_validate(config)
        self.host = EngineHost(cfg, "decode", registry)
        self.stream_interval_s = cfg.stream_interval_ms / 1000
        self.local_prefill_tokens = cfg.routing.local_prefill_tokens
        kv = self.host.engine.runner.kv_pool
        self.receiver = KVReceiver(kv, fingerprint_for(kv, cfg.model_name), cfg.transfer.transfer_config(),
                                   host=kv_bind_host(cfg.transfer.host))
        log.info("decode replica %s receives KV at %s", self.host.replica_id, self.receiver.address)

    def record_replica_metadata(self) -> dict:
        return {"kv_address": self.receiver.address}

    def kv_health(self) -> str:
        return self.receiver.health()

    async def generate(self, data: bytes):
        self.host.start_stats_pusher()
        try:
            req = messages.decode(data, expect=messages.DecodeRequest)
        except messages.MessageError as exc:
            yield error_event("", str(exc), 400, "invalid_request_error")
            return
        rid = req.request_id
        params = req.params.to_params()
        prepared = asyncio.ensure_future(self.host.aengine.prepare(params))   # awaited at step 4
        # 0. place, 1. reserve (one engine call)
        reserved = await self._reserve(list(req.prompt_token_ids) + list(req.resumed_token_ids), params)
        if reserved is _LOCAL:
            async for event in self._local(req, params, prepared):
                yield event
            return
        if reserved is None:
            yield error_event(rid, "decode replica is out of KV blocks; retry later", 503, "overloaded")
            return
        blocks, cached = reserved
        # 2. expect, 3. await the push
        try:
            transfer = self.receiver.expect(rid, blocks[cached:])
        except (ValueError, RuntimeError) as exc:      # a duplicate id, or the receiver is closed
            self._release(blocks)
            yield error_event(rid, f"cannot reserve: {exc}", 400 if isinstance(exc, ValueError) else 503)
            return
        resolved = False
        try:
            yield messages.encode(messages.Reserved(rid, self.receiver.address, len(blocks) - cached, cached))
            result = await asyncio.shield(asyncio.wrap_future(transfer))
            resolved = True
        finally:
            if not resolved:         # the router left: drop the reservation now
                self.receiver.cancel(rid)
                transfer.add_done_callback(lambda _: self._release(blocks))
        handoff = self._handoff(result)
        if isinstance(handoff, str):
            self._release(blocks)
            self.host.count("kv_transfers_failed")
            yield error_event(rid, f"KV transfer failed: {handoff}", 502)
            return
        self.host.count("kv_transfers_landed")
        self.host.count("kv_bytes_received", result.nbytes)
        self.host.count("kv_blocks_reused", cached)
        try:
            yield messages.encode(messages.Landed(rid))
            await prepared
        except BaseException:        # the router left (GeneratorExit, cancelled): the blocks are still ours
            self._release(blocks)
            raise
        # 4. admit, 5. stream

        def admit(engine):
            out = engine.add_prefilled(rid, list(req.prompt_token_ids), handoff.first_token, params, blocks,
                                       handoff.shown_chars, list(req.resumed_token_ids))
            if isinstance(out, Rejected):
                engine.release_reservation(blocks)
            else:
                self.host.count("requests_decoded")
            return out

        # the first output repeats the prefill's first token (the router drops it): it is held
        # like the rest, so a request costs one message less
        async for event in engine_events(self.host.aengine, rid, admit, self.stream_interval_s, hold_first=True):
            yield event

    async def _local(self, req: messages.DecodeRequest, params, prepared: asyncio.Future):
        """Step 0's prefill here: the request's events, as a colocated replica streams them (its
        first is the first token, at once). The engine owns the request's blocks from admission;
        leaving early aborts it there (AsyncEngine.stream), which frees them."""
        rid = req.request_id
        await prepared

        def admit(engine):
            out = engine.add_request(rid, list(req.prompt_token_ids), params, resumed=list(req.resumed_token_ids),
                                     shown_chars=req.shown_chars)
            if not isinstance(out, Rejected):
                self.host.count("requests_decoded")
                self.host.count("prefills_local")
            return out

        async for event in engine_events(self.host.aengine, rid, admit, self.stream_interval_s):
            yield event

    @staticmethod
    def _handoff(result) -> messages.KVHandoff | str:
        """The first token that came with a landed push, or why there is none."""
        if not result.ok:
            return result.error
        try:
            return messages.decode(result.meta, expect=messages.KVHandoff)
        except messages.MessageError as exc:
            return f"bad hand-off from the prefill replica: {exc}"

    async def _reserve(self, token_ids: list[int], params) -> tuple[list[int], int] | object | None:
        """Steps 0 and 1 in one engine call: `_LOCAL` where the prefix cache holds `token_ids`'
        beginning and the engine's prompt tokens to compute, their uncached ones among them, would
        be at most `local_prefill_tokens` (so a decode step carries no more than about that; a
        prompt none of whose blocks are here would only move the same work from the prefill pool
        into the decode steps); else (blocks, how many lead blocks are cached) (`reserve_cached`:
        with the priority policy, running requests of a lower priority preempted for them), or
        None when too few are free."""
        limit = self.local_prefill_tokens

        def place(e):
            if limit and (cached := e.cached_prompt_tokens(token_ids, params)) \
                    and e.prefill_backlog(token_ids, params, cached) <= limit:
                return _LOCAL
            return e.reserve_cached(token_ids, params.cache_key, params.priority)

        fut = self.host.aengine.submit(place)
        try:
            return await asyncio.shield(asyncio.wrap_future(fut))
        except asyncio.CancelledError:
            fut.add_done_callback(lambda f: f.exception() is None and isinstance(f.result(), tuple)
                                  and self._release(f.result()[0]))
            raise

    def _release(self, blocks: list[int]) -> None:
        self.host.aengine.submit(lambda e: e.release_reservation(blocks))

    def close_kv(self) -> None:
        """At shutdown: fail open reservations and stop the receiver's threads and store."""
        self.receiver.close()
