"""Prefill replica: a Serve deployment holding an engine in the prefill role.

Life cycle of a request here (`prefill`, a streaming call; the decode replica has already
reserved blocks for the K/V under the request's id at `kv_address`)
  1. admit    one engine call checks the request (context length, parameters; a bad one is
              a 400 result) and queues the prompt (a resumed request's: with the output tokens
              the client already has, whose K/V is computed and pushed with the prompt's); a
              structured-output request's grammar is compiled first, on a worker thread, so the
              engine thread only copies it (`AsyncEngine.prepare`, which also reads a LoRA adapter
              loaded at run time)
  2. prefill  the engine batches waiting prompts under its token budget with chunked
              prefill, samples the first token, and holds the prompt's blocks
  3. push     a hand-off task starts sending the blocks into the reservation at once, with the
              first token (a KVHandoff in the transfer's meta), less the leading blocks the
              decode replica holds already (`skip_blocks`): the reservation exists, so the
              push never waits for one
  4. answer   yield the first token (PrefillResult) at once: TTFT does not wait for the push
  5. release  the hand-off task frees the held blocks when the push ends (ack or failure);
              the stream ends with a HandoffDone
When the first token already ends the request (EOS, max_tokens=1) step 3 is skipped and the
blocks are released before the answer.
Timing: `queue_seconds` runs from the call's arrival here to the engine first scheduling the
request, `prefill_seconds` from then to the first token; both travel in the PrefillResult. The
push's time and size go to this replica's histograms (`kv_transfer_seconds`, `kv_transfer_bytes`).
Block ownership: the engine holds the blocks from step 2; once the first token exists the
hand-off task owns them and always releases them (step 5), whatever happens to the caller. A
failed engine step never frees them (the engine fails only requests it steps). Leaving during
step 2 (router cancelled) aborts the request, which frees them. Leaving during the push (the
router abandoned the request: client gone, decode replica failed) cancels a push still waiting
for a pair at once; one whose data is moving runs to its end (the decode side, told too, drains
it) and then frees the blocks.
An embedding (`embed`, /v1/embeddings) runs here too, prefill alone: admitted like a prompt, its
chunks batched with the others, its final hidden states pooled at its last chunk
(serving/replica_util.py `embed_events`); nothing is pushed, its blocks are freed at once.
Shutdown: the call lasts until its push ends, so Serve's graceful shutdown (which waits for
ongoing calls, up to graceful_shutdown_timeout_s) never cuts a push. Then `close_kv` (from
Serve's `__del__`) lets any push left in the send pool finish and closes the sender's pairs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time

from ray import serve

from engine.async_engine import EngineDeadError
from engine.outputs import Rejected
from kv_transfer import KVSender, TransferResult, fingerprint_for
from serving import messages
from serving.config import AppConfig
from serving.engine_host import EngineHost, EngineReplica
from serving.replica_util import embed_events

log = logging.getLogger(__name__)


@serve.deployment
class PrefillServer(EngineReplica):
    def __init__(self, config: dict, registry=None):
        cfg = AppConfig.model_validate(config)
        self.host = EngineHost(cfg, "prefill", registry)
        kv = self.host.engine.runner.kv_pool
        transfer = cfg.transfer.transfer_config()
        self.sender = KVSender(kv, fingerprint_for(kv, cfg.model_name), transfer)
        self._send_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=2 * transfer.max_pairs_per_peer, thread_name_prefix="kv-send")
        self._handoffs: set[asyncio.Task] = set()
        self._abandoned: set[str] = set()     # pushes the router gave up on before they started

    async def prefill(self, data: bytes):
        arrived = time.monotonic()
        self.host.start_stats_pusher()
        try:
            req = messages.decode(data, expect=messages.PrefillRequest)
        except messages.MessageError as exc:
            yield messages.encode(messages.PrefillResult("", error=str(exc), error_code=400))
            return
        rid, ids, params = req.request_id, list(req.prompt_token_ids), req.params.to_params()
        resumed = list(req.resumed_token_ids)
        # 1. admit, 2. prefill
        await self.host.aengine.prepare(params)
        first = None
        try:
            async for out in self.host.aengine.stream(
                    rid, lambda e: e.add_request(rid, ids, params, hold_blocks=True, resumed=resumed,
                                                 shown_chars=req.shown_chars)):
                first = out
        except EngineDeadError as exc:
            yield messages.encode(messages.PrefillResult(rid, error=str(exc), error_code=500))
            return
        if isinstance(first, Rejected):
            yield messages.encode(messages.PrefillResult(rid, error=first.reason, error_code=first.code))
            return
        if first.error is not None:           # failed on its own; the engine freed its blocks
            yield messages.encode(messages.PrefillResult(rid, error=first.error, error_code=first.error_code))
            return
        assert first is not None and first.finished
        done = time.monotonic()
        scheduled = first.first_scheduled_time or done
        result = messages.PrefillResult(
            rid, first.new_token_ids[0], first.finish_reason, first.num_cached_tokens, done - scheduled,
            scheduled - arrived, first_text=first.new_text,
            first_logprobs=first.logprobs[0] if first.logprobs else None,
            prompt_logprobs=tuple(first.prompt_logprobs or ()), stop_reason=first.stop_reason)
        if first.finish_reason is not None:
            self.host.aengine.submit(lambda e: e.release(rid))
            yield messages.encode(result)
            return
        # 3. push (a task the caller cannot cancel), 4. answer, 5. its end
        handoff = messages.KVHandoff(first.new_token_ids[0], req.shown_chars + len(first.new_text))
        task = asyncio.ensure_future(self._push(req.kv_address, rid, handoff, req.skip_blocks))
        self._handoffs.add(task)
        task.add_done_callback(self._handoffs.discard)
        try:
            yield messages.encode(result)
            res = await asyncio.shield(task)
        except (asyncio.CancelledError, GeneratorExit):
            if not task.done():
                self._abandon(rid)
            raise
        yield messages.encode(messages.HandoffDone(rid, res.ok, res.error))

    async def embed(self, data: bytes):
        """An `EmbedRequest`'s one answer (`embed_events`)."""
        self.host.start_stats_pusher()
        async for event in embed_events(self.host.aengine, data):
            yield event

    async def _push(self, address: str, rid: str, handoff: messages.KVHandoff, skip: int) -> TransferResult:
        """Owns the held blocks: sends them, less the `skip` leading ones the decode replica
        holds already, then always releases them."""
        loop = asyncio.get_running_loop()
        meta = messages.encode(handoff)
        try:
            blocks = await self.host.aengine.call(lambda e: e.held_blocks(rid))
            if not 0 <= skip < len(blocks):   # the decode side always receives the last block
                res = TransferResult.failure(rid, f"skip_blocks {skip} out of range for {len(blocks)} blocks")
            else:
                res = await loop.run_in_executor(self._send_pool, self._send, address, rid, blocks[skip:], meta)
            self.host.count("kv_transfers_sent" if res.ok else "kv_transfers_failed")
            if res.ok:
                self.host.count("kv_bytes_sent", res.nbytes)
                self.host.observe("kv_transfer_seconds", res.seconds)
                self.host.observe("kv_transfer_bytes", res.nbytes)
            else:
                log.warning("KV transfer of %s to %s failed: %s", rid, address, res.error)
            return res
        finally:
            self._abandoned.discard(rid)
            self.host.aengine.submit(lambda e: e.release(rid))

    def _send(self, address: str, rid: str, blocks: list[int], meta: bytes) -> TransferResult:
        if rid in self._abandoned:        # given up before its turn in the send pool
            return TransferResult.failure(rid, "abandoned by the router before it started")
        return self.sender.send(address, rid, blocks, meta)

    def _abandon(self, rid: str) -> None:
        """The router gave the request up: a push that has not moved data yet is dropped now
        (one already moving runs to its end; the decode side drains it)."""
        self._abandoned.add(rid)
        self.sender.cancel(rid)

    def close_kv(self) -> None:
        """At shutdown: let the pushes already handed to the send pool finish (a decode replica
        waits for each; every one is bounded by the transfer timeout), then close the sender
        (each decode replica gets a Bye)."""
        self._send_pool.shutdown(wait=True)
        self.sender.close()
