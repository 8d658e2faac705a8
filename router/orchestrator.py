"""Runs one request across the pools and yields its TokenEvents.

Disaggregated, three steps (the order matters for block ownership):
  1. choose the decode replica (a slot is reserved on it; its KV address is in its metadata);
  2. prefill on a prefill replica with that address: it returns the first token at once and
     pushes the prompt's KV to the decode replica in the background;
  3. yield the first token (and its text, detokenized by the prefill replica) at once;
  4. dispatch the decode to exactly the chosen replica: it reserves blocks, receives the KV (the
     push waits for the reservation) and streams the tokens after the first.
If the first token already ends the request, steps 3-4 are one final event and the decode slot
is released. TTFT is thus the prefill's latency, not prefill + KV transfer + decode admission.
A prefill replica that dies during step 2 is retried once (a fresh request id, so a push the dead
replica may have started is drained by the decode side and never confused with the retry's).
Each prefill that succeeds is timed into `metrics` (router/metrics.py): queue = the wait for
the decode slot in step 1 plus the prefill replica's queue_seconds; prefill = its prefill_seconds.
Colocated: one call to the colocated pool.
Failures raise `RequestFailed` with the HTTP status to report. Leaving the iterator early (client
gone, deadline, failure) cancels the replica calls explicitly (`.cancel()` on the Serve response),
which aborts the request there and frees its blocks: cancelling the asyncio task that awaits a
Serve response does not cancel the request on the replica, and the proxy's cancellation of the
whole HTTP request only reaches it while the router's handler is still running.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import AsyncIterator

from ray.exceptions import RayError
from ray.serve.exceptions import BackPressureError, RayServeException

from serving import messages
from serving.messages import WireSamplingParams


PREFILL_ATTEMPTS = 2   # a prefill replica that dies mid-request is retried once on another


class RequestFailed(Exception):
    def __init__(self, code: int, message: str, kind: str = "server_error"):
        super().__init__(message)
        self.code, self.message, self.kind = code, message, kind


def _check(event) -> messages.TokenEvent:
    if isinstance(event, messages.ErrorEvent):
        raise RequestFailed(event.code, event.message, event.kind)
    return event


class Orchestrator:
    def __init__(self, mode: str, prefill=None, decode=None, colocated=None, metrics=None):
        self.mode = mode
        self.metrics = metrics   # a router.metrics.RequestMetrics, or None
        if mode == "colocated":
            self.colocated = colocated.options(stream=True).generate
        else:
            self.prefill = prefill.prefill
            self.decode = decode.options(stream=True).generate
            self._decode_handle = decode.options(stream=True)

    async def run(self, rid: str, prompt: list[int], params) -> AsyncIterator[messages.TokenEvent]:
        events = self._run(rid, prompt, params)
        try:
            async for event in events:
                yield event
        except RequestFailed:
            raise
        except BackPressureError as exc:
            raise RequestFailed(429, f"a pool is at capacity, retry later ({exc})", "overloaded") from None
        except (RayError, RayServeException) as exc:  # e.g. ReplicaUnavailableError: it died
            raise RequestFailed(503, f"a replica failed while serving the request: {type(exc).__name__}",
                                "server_error") from None
        finally:
            await events.aclose()     # closed here, not whenever it is collected: its replica calls end now

    async def _prefill(self, rid: str, prompt: list[int], wire, address: str) -> messages.PrefillResult:
        for attempt in range(PREFILL_ATTEMPTS):
            attempt_rid = rid if attempt == 0 else f"{rid}-retry{attempt}"
            response = self.prefill.remote(messages.encode(
                messages.PrefillRequest(attempt_rid, tuple(prompt), wire, address)))
            try:
                data = await response
                return messages.decode(data, expect=messages.PrefillResult)
            except asyncio.CancelledError:
                response.cancel()
                raise
            except RayError:
                if attempt == PREFILL_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    async def _run(self, rid: str, prompt: list[int], params) -> AsyncIterator[messages.TokenEvent]:
        wire = WireSamplingParams.of(params)
        if self.mode == "colocated":
            stream = self.colocated.remote(messages.encode(messages.GenerateRequest(rid, tuple(prompt), wire)))
            finished = False
            try:
                async for data in stream:
                    yield _check(messages.decode(data))
                finished = True
            finally:
                if not finished:          # client gone, deadline or failure: stop the replica's work
                    stream.cancel()
            return
        # 1. choose the decode replica
        arrived = time.monotonic()
        async with self.decode.choose_replica() as selection:
            address = selection.replica_metadata.get("kv_address")
            if not address:
                raise RequestFailed(503, "the chosen decode replica has no KV address yet", "overloaded")
            # 2. prefill there (once more, under a fresh id, if the prefill replica died)
            waited = time.monotonic() - arrived
            result = await self._prefill(rid, prompt, wire, address)
            rid = result.request_id
            if result.error is not None:
                kind = "invalid_request_error" if result.error_code == 400 else "server_error"
                raise RequestFailed(result.error_code, result.error, kind)
            if self.metrics is not None:
                self.metrics.observe_prefill(waited + result.queue_seconds, result.prefill_seconds)
            # 3. the first token, straight from the prefill replica
            done = result.finish_reason is not None
            first_logprobs = () if result.first_logprobs is None else (result.first_logprobs,)
            yield messages.TokenEvent(rid, (result.first_token,), result.first_text, done,
                                      result.finish_reason, len(prompt), 1, result.num_cached_tokens,
                                      first_logprobs, result.prompt_logprobs)
            if done:
                return
            # 4. decode on exactly that replica; its first event repeats the first token (and
            #    carries no logprobs: the prefill replica's came with step 3)
            stream = self._decode_handle.dispatch(selection, messages.encode(messages.DecodeRequest(
                rid, tuple(prompt), result.first_token, wire, len(result.first_text))))
            first, finished = True, False
            try:
                async for data in stream:
                    event = _check(messages.decode(data))
                    if first:
                        first = False
                        event = dataclasses.replace(event, token_ids=event.token_ids[1:])
                        if not (event.token_ids or event.text or event.finished):
                            continue
                    yield event
                finished = True
            finally:
                if not finished:          # client gone, deadline or failure: stop the replica's work
                    stream.cancel()

