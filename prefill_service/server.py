"""Prefill replica: a Serve deployment holding an engine in the prefill role.

Life cycle of a request here (`prefill`)
  1. admit    one engine call checks the request (context length, parameters; a bad one is
              a 400 result) and queues the prompt
  2. prefill  the engine batches waiting prompts under its token budget with chunked
              prefill, samples the first token, and holds the prompt's blocks
  3. answer   return the first token at once (TTFT does not wait for the transfer)
  4. push     in the background, send the blocks to the decode replica at `kv_address`;
  5. release  free the held blocks after the ack or on failure
When the first token already ends the request (EOS, max_tokens=1) step 4 is skipped.
Timing: `queue_seconds` runs from the call's arrival here to the engine first scheduling the
request, `prefill_seconds` from then to the first token; both travel in the PrefillResult. The
push (step 4) ends after the result is returned, so its time and size go to this replica's
histograms (`kv_transfer_seconds`, `kv_transfer_bytes`) and reach /metrics with the stats.
Block ownership: the engine holds the blocks from step 2; once the first token exists a
shielded hand-off task owns them and always releases them (step 5), whatever happens to the
caller. Leaving during step 2 (router cancelled) aborts the request, which frees them.
Shutdown (`close_kv`, from Serve's `__del__`, after Serve has drained the replica's requests): the
pushes already in the send pool finish, then the sender closes its pairs; then the engine stops.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time

from ray import serve

from engine.async_engine import EngineDeadError
from engine.outputs import Rejected
from kv_transfer import KVSender, fingerprint_for
from serving import messages
from serving.config import AppConfig
from serving.engine_host import EngineHost, EngineReplica

log = logging.getLogger(__name__)


@serve.deployment
class PrefillServer(EngineReplica):
    def __init__(self, config: dict, registry=None):
        cfg = AppConfig.model_validate(config)
        self.host = EngineHost(cfg, "prefill", registry)
        kv = self.host.engine.runner.kv_pool
        self.sender = KVSender(kv, fingerprint_for(kv, cfg.model_name), cfg.transfer.transfer_config())
        self._send_pool = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="kv-send")
        self._handoffs: set[asyncio.Task] = set()

    async def prefill(self, data: bytes) -> bytes:
        arrived = time.monotonic()
        self.host.start_stats_pusher()
        try:
            req = messages.decode(data, expect=messages.PrefillRequest)
        except messages.MessageError as exc:
            return messages.encode(messages.PrefillResult("", error=str(exc), error_code=400))
        rid, ids, params = req.request_id, list(req.prompt_token_ids), req.params.to_params()
        # 1. admit, 2. prefill
        first = None
        try:
            async for out in self.host.aengine.stream(
                    rid, lambda e: e.add_request(rid, ids, params, hold_blocks=True)):
                first = out
        except EngineDeadError as exc:
            return messages.encode(messages.PrefillResult(rid, error=str(exc), error_code=500))
        if isinstance(first, Rejected):
            return messages.encode(messages.PrefillResult(rid, error=first.reason, error_code=400))
        assert first is not None and first.finished
        done = time.monotonic()
        scheduled = first.first_scheduled_time or done
        # 3. answer, 4. push and 5. release in a task the caller cannot cancel
        task = asyncio.ensure_future(self._handoff(req, first, scheduled - arrived, done - scheduled))
        self._handoffs.add(task)
        task.add_done_callback(self._handoffs.discard)
        return await asyncio.shield(task)

    async def _handoff(self, req: messages.PrefillRequest, first, queue_s: float, prefill_s: float) -> bytes:
        rid = req.request_id
        result = messages.PrefillResult(rid, first.new_token_ids[0], first.finish_reason,
                                        first.num_cached_tokens, prefill_s, queue_s, first_text=first.new_text,
                                        first_logprobs=first.logprobs[0] if first.logprobs else None,
                                        prompt_logprobs=tuple(first.prompt_logprobs or ()))
        if first.finish_reason is not None:
            await self.host.aengine.call(lambda e: e.release(rid))
        else:
            blocks = await self.host.aengine.call(lambda e: e.held_blocks(rid))
            push = asyncio.ensure_future(self._push(req.kv_address, rid, blocks))
            self._handoffs.add(push)
            push.add_done_callback(self._handoffs.discard)
        return messages.encode(result)

    async def _push(self, address: str, rid: str, blocks: list[int]) -> None:
        loop = asyncio.get_running_loop()
        try:
            res = await loop.run_in_executor(self._send_pool, self.sender.send, address, rid, blocks)
            self.host.count("kv_transfers_sent" if res.ok else "kv_transfers_failed")
            if res.ok:
                self.host.count("kv_bytes_sent", res.nbytes)
                self.host.observe("kv_transfer_seconds", res.seconds)
                self.host.observe("kv_transfer_bytes", res.nbytes)
            else:
                log.warning("KV transfer of %s to %s failed: %s", rid, address, res.error)
        finally:
            self.host.aengine.submit(lambda e: e.release(rid))

    def close_kv(self) -> None:
        """At shutdown: let the pushes already handed to the send pool finish (a decode replica
        waits for each; every one is bounded by the transfer timeout), then close the sender
        (each decode replica gets a Bye)."""
        self._send_pool.shutdown(wait=True)
        self.sender.close()
