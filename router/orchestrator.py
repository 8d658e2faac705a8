"""Runs one request across the pools and yields its TokenEvents.

Disaggregated, four steps (the order is the block ownership):
  1. reserve: choose the decode replica and open its decode stream first; it reserves blocks
     for the prompt's K/V and answers `Reserved` (the reservation's identity: the request id at
     its KV address), or refuses at once (out of KV blocks: a 503 before any prefill ran);
  2. prefill on a prefill replica with that identity (a stream): its first event is the first
     token, and meanwhile it pushes the K/V, with the first token, into the reserved blocks
     (which already exist: no push waits), less the leading blocks the decode replica said it
     holds already (`cached_blocks`); the rest of that stream (the push's end) is read in
     the background;
  3. yield the first token (and its text, detokenized by the prefill replica) at once;
  4. stream the decode stream's tokens after the first: the decode replica answers `Landed` when
     the K/V is in its blocks (the caller's `ready` is called: router/choices.py starts the other
     choices of the prompt, whose reservations now find its blocks), then admits the request. A push lost before `Landed` (the prefill
     replica died after the first token: its stream ends in a replica error instead of
     `HandoffDone`; or it reports the push failed, e.g. no pair to the decode replica within the
     connect timeout, which the decode side never hears of) fails the request after
     HANDOFF_GRACE_S for a `Landed` (or the decode side's own error) already on its way: a 503
     for a dead replica, a 502 for a failed push, and the reservation is dropped at once
     (before, the request waited out the reservation's lease: two minutes by default).
If the first token already ends the request, step 3 is one final event and the decode stream is
cancelled (the reservation is dropped). TTFT is the reservation's round trip plus the prefill's
latency, not prefill + KV transfer + decode admission.
A decode replica whose prefix cache holds the prompt's beginning and all but a few of its tokens
(`routing.local_prefill_tokens`: a conversation's next turn) computes them itself: instead of
`Reserved` in step 1 its stream's first event is the first token, and steps 2-4 do not happen (no
prefill replica, no hand-off; `ready` is called at that first token).
A replica that dies is not the request's end: the request starts over from step 1 after each
delay of `retry_delays_s` (default RETRY_DELAYS_S: 0.25 s doubling to 2 s, ~14 s in all, longer
than the gap a redeploy leaves between a pool's old replica stopping and its new one serving,
during which the handle still offers the old one: 7.6 s in a CI run; an attempt that got tokens
out before its replica died is followed at once, the pool's other replicas being likely alive,
its delay skipped but still counted), each time with a fresh
request id and reservation, so a push the dead replica may have started is refused by the decode
side and never confused with the retry's. That covers the decode replica gone before step 1
answered (as when Serve removes a replica between choosing and dispatching), the prefill replica
dead before its first token or during its push (before `Landed`), and the decode replica dead
before `Landed` or mid-stream. Once tokens are out, the new attempt is a resumed request
(migration): the prompt plus the output tokens the client already has and the characters of
their text it was shown; the prefill replica computes both (its prefix cache usually holds the
prompt), samples the next token and pushes their K/V; the stream goes on as the uninterrupted
request would have (greedy or sampled, every sampled request having a seed from the router
(router/choice_view.py `choice_params`): the same tokens; penalties, stop strings and max_tokens
count the resumed tokens), with no prompt logprobs again; its events' counts of drafts from a
predicted output add the earlier attempts' (the usage's). A push that a live replica reports
failed (502), a replica's own error event, and a refusal stay the request's end. Colocated: the
same, one call to the colocated pool per attempt.
Embeddings (`embed`): a group of prompts is one call to the prefill pool (colocated: its pool),
which answers with their vectors: no decode replica, no hand-off; a replica that dies first is asked
again.
Each prefill that succeeds is timed into `metrics` (router/metrics.py): queue = the wait for the
decode reservation in step 1 plus the prefill replica's queue_seconds; prefill = its prefill_seconds.
Failures raise `RequestFailed` with the HTTP status to report. Leaving the iterator early (client
gone, deadline, failure) cancels both replica calls explicitly (`.cancel()` on the Serve
responses): the decode replica drops the reservation at once, the prefill replica a push that
has not started (a push already moving runs to its end into the dropped reservation, which the
decode side drains) or the prefill itself, freeing its blocks. Cancelling the asyncio task that
awaits a Serve response does not cancel the request on the replica, and the proxy's
cancellation of the whole HTTP request only reaches it while the router's handler is still
running.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import AsyncIterator, Callable

from ray.exceptions import RayError
from ray.serve.exceptions import BackPressureError, RayServeException, ReplicaUnavailableError

from router.wake import PoolWaker
from serving import messages
from serving.ray_compat import direct_stream
from serving.messages import WireSamplingParams


RETRY_DELAYS_S = (0.0, 0.25, 0.5, 1.0) + (2.0,) * 6   # before each attempt (see the module docstring)
HANDOFF_GRACE_S = 2.0   # after a push was lost (see step 4): how long a `Landed` may still be on its way
WAKE_AFTER_S = 0.25     # a reservation slower than this may be a decode pool starting: wake the prefill pool
_GONE = (RayError, ReplicaUnavailableError)   # a replica died, or was removed before the dispatch


class RequestFailed(Exception):
    def __init__(self, code: int, message: str, kind: str = "server_error"):
        super().__init__(message)
        self.code, self.message, self.kind = code, message, kind


def _check(event) -> messages.TokenEvent:
    if isinstance(event, messages.ErrorEvent):
        raise RequestFailed(event.code, event.message, event.kind)
    return event


def _cancel(response) -> None:
    """Cancel a Serve response. One whose dispatch failed (its replica gone) re-raises that error
    from `cancel()`; there is nothing to cancel then, and raising here would replace the error
    being handled (a `_StartOver` would become a 503)."""
    try:
        response.cancel()
    except (*_GONE, RayServeException):
        pass


def _abandon(task: asyncio.Task) -> None:
    """Cancel a pending read of a decode stream that is no longer awaited (the request ended or
    failed first). Serve's handle may end it with RequestCancelledError: retrieved here, unlogged."""
    if not task.done():
        task.cancel()
        task.add_done_callback(lambda t: t.cancelled() or t.exception())


class _StartOver(Exception):
    """A replica died: the request may start over (resumed after the tokens already out). Its
    `__cause__` is the error to report when no attempt is left."""


def _start_over(cause: BaseException) -> _StartOver:
    failed = _StartOver()
    failed.__cause__ = cause
    return failed


class Orchestrator:
    def __init__(self, mode: str, prefill=None, decode=None, colocated=None, metrics=None,
                 retry_delays_s: tuple[float, ...] = RETRY_DELAYS_S, wake_prefill: bool = False):
        self.mode = mode
        self.retry_delays_s = retry_delays_s
        self.metrics = metrics   # a router.metrics.RequestMetrics, or None
        # a prefill pool that scales to zero starts with the decode pool (router/wake.py)
        self.prefill_waker = PoolWaker(prefill) if wake_prefill else None
        self._followers: set[asyncio.Task] = set()   # prefill streams read to the push's end
        # every token crosses these calls: Serve's gRPC transport (ray_compat.direct_stream)
        largest = messages.MAX_MESSAGE_BYTES
        if mode == "colocated":
            self.colocated = direct_stream(colocated.options(stream=True), largest).generate
        else:
            self.prefill = direct_stream(prefill.options(stream=True), largest).prefill
            self.decode = direct_stream(decode.options(stream=True), largest).generate
        self.embedder = direct_stream((colocated if mode == "colocated" else prefill).options(stream=True),
                                      largest).embed

    async def embed(self, rid: str, prompts: list[list[int]], params) -> messages.Embedded:
        """The embeddings of `prompts` (SamplingParams `params` with its pooling) from the prefill pool
        (colocated: its pool), in one call answered by an `Embedded`. A replica that dies before it
        answers is asked again under a fresh request id after each of `retry_delays_s`; leaving early
        cancels the call, which aborts the prompts there (their blocks freed). Failures raise
        RequestFailed."""
        wire = WireSamplingParams.of(params)
        for attempt, delay in enumerate(self.retry_delays_s):
            if delay:
                await asyncio.sleep(delay)
            call = self.embedder.remote(messages.encode(messages.EmbedRequest(
                rid if attempt == 0 else f"{rid}-retry{attempt}", tuple(map(tuple, prompts)), wire)))
            answered = False
            try:
                answer = _check(messages.decode(await call.__anext__()))
                assert isinstance(answer, messages.Embedded), answer
                answered = True
                return answer
            except _GONE as exc:
                if attempt == len(self.retry_delays_s) - 1:
                    raise RequestFailed(503, f"a replica failed while serving the request: {type(exc).__name__}",
                                        "server_error") from None
            except BackPressureError as exc:
                raise RequestFailed(429, f"a pool is at capacity, retry later ({exc})", "overloaded") from None
            except (RayError, RayServeException) as exc:
                raise RequestFailed(503, f"a replica failed while serving the request: {type(exc).__name__}",
                                    "server_error") from None
            finally:
                if not answered:      # failed, or the caller left: stop the replica's work
                    _cancel(call)
        raise AssertionError("unreachable")

    async def run(self, rid: str, prompt: list[int], params,
                  ready: Callable[[], None] = lambda: None) -> AsyncIterator[messages.TokenEvent]:
        """The request's TokenEvents. `ready` is called once the prompt's K/V is where another
        request with the same prompt finds it (router/choices.py starts a group's other choices
        then): landed in the decode replica (step 4), colocated at the first token; again after
        each migration."""
        events = self._run(rid, prompt, params, ready)
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

    async def _run(self, rid: str, prompt: list[int], params, ready) -> AsyncIterator[messages.TokenEvent]:
        wire = WireSamplingParams.of(params)
        resumed: list[int] = []      # output tokens the client has
        shown = 0                    # characters of their text
        drafted = (0, 0)             # prediction drafts kept and not, as the client last saw them
        carried = (0, 0)             # ... counted by the attempts before this one
        progressed = False           # the last attempt got tokens out before its replica died
        for attempt, delay in enumerate(self.retry_delays_s):
            if delay and not progressed:   # after tokens went out, at once: the pool's others likely serve
                await asyncio.sleep(delay)
            attempt_id = rid if attempt == 0 else f"{rid}-retry{attempt}"
            if resumed:              # migration: go on after what is out (prompt logprobs came with it)
                wire = dataclasses.replace(wire, prompt_logprobs=None)
                if self.metrics is not None:
                    self.metrics.migrated()
            run = (self._colocated(attempt_id, prompt, wire, tuple(resumed), shown, ready)
                   if self.mode == "colocated" else self._handoff(attempt_id, prompt, wire, tuple(resumed), shown, ready))
            finished = progressed = False
            try:
                async for event in run:
                    resumed += event.token_ids
                    shown += len(event.text)
                    finished, progressed = event.finished, True
                    if carried != (0, 0):     # an event counts its attempt's drafts: the request's are wanted
                        event = dataclasses.replace(
                            event, accepted_prediction_tokens=event.accepted_prediction_tokens + carried[0],
                            rejected_prediction_tokens=event.rejected_prediction_tokens + carried[1])
                    drafted = event.accepted_prediction_tokens, event.rejected_prediction_tokens
                    yield event
                return
            except _StartOver as failed:
                if finished:          # the last event is out: nothing to go on with
                    return
                carried = drafted
                if attempt == len(self.retry_delays_s) - 1:
                    raise failed.__cause__ from None
            finally:
                await run.aclose()    # now, not when collected: its replica calls end here
        raise AssertionError("unreachable")

    async def _colocated(self, rid: str, prompt: list[int], wire, resumed: tuple[int, ...],
                         shown: int, ready) -> AsyncIterator[messages.TokenEvent]:
        stream = self.colocated.remote(messages.encode(
            messages.GenerateRequest(rid, tuple(prompt), wire, resumed, shown)))
        finished = False
        try:
            try:
                async for data in stream:
                    event = _check(messages.decode(data))
                    ready()           # the prompt is in the replica's prefix cache
                    yield event
            except _GONE as exc:
                raise _StartOver() from exc
            finished = True
        finally:
            if not finished:          # client gone, deadline or failure: stop the replica's work
                _cancel(stream)

    async def _handoff(self, rid: str, prompt: list[int], wire, resumed: tuple[int, ...] = (),
                       shown: int = 0, ready=lambda: None) -> AsyncIterator[messages.TokenEvent]:
        arrived = time.monotonic()
        decode = self.decode.remote(messages.encode(
            messages.DecodeRequest(rid, tuple(prompt), wire, resumed, shown)))
        prefill, decode_ended, abandoned = None, False, True
        try:
            # 1. the reservation (or a refusal, at once; or the first token of a local prefill)
            try:
                reserved = _check(messages.decode(await self._reservation(decode)))
            except _GONE as exc:
                raise _StartOver() from exc
            except RequestFailed as failed:
                if failed.code == 503 and self.metrics is not None:   # out of KV: the SLO policy's signal
                    self.metrics.window.refused(time.monotonic())
                raise
            if isinstance(reserved, messages.TokenEvent):   # prefilled in the decode replica: its K/V is there
                if self.metrics is not None:                # the SLO policy prices it in the decode steps
                    self.metrics.window.local(time.monotonic(),
                                              reserved.num_prompt_tokens - reserved.num_cached_tokens)
                ready()
                yield reserved
                try:
                    async for data in decode:
                        yield _check(messages.decode(data))
                except _GONE as exc:  # the decode replica died mid-stream
                    raise _StartOver() from exc
                decode_ended, abandoned = True, False
                return
            assert isinstance(reserved, messages.Reserved), reserved
            waited = time.monotonic() - arrived
            # 2. prefill with the reservation's identity
            prefill = self.prefill.remote(messages.encode(
                messages.PrefillRequest(rid, tuple(prompt), wire, reserved.kv_address, resumed, shown,
                                        reserved.cached_blocks)))
            try:
                result = messages.decode(await prefill.__anext__(), expect=messages.PrefillResult)
            except _GONE as exc:
                raise _StartOver() from exc
            if result.error is not None:
                kind = "invalid_request_error" if result.error_code == 400 else "server_error"
                raise RequestFailed(result.error_code, result.error, kind)
            follower = self._follow(prefill)
            if self.metrics is not None:
                self.metrics.observe_prefill(waited + result.queue_seconds, result.prefill_seconds)
            # 3. the first token, straight from the prefill replica
            done = result.finish_reason is not None
            first_logprobs = () if result.first_logprobs is None else (result.first_logprobs,)
            yield messages.TokenEvent(rid, (result.first_token,), result.first_text, done,
                                      result.finish_reason, len(prompt), len(resumed) + 1,
                                      result.num_cached_tokens, first_logprobs, result.prompt_logprobs,
                                      result.stop_reason)
            if done:
                abandoned = False     # `finally` drops the reservation; the prefill stream ends
                return
            # 4. the decode stream: `Landed`, then token events; the first repeats the first
            #    token (and carries no logprobs: the prefill replica's came with step 3)
            await self._landing(decode, follower)
            ready()
            first = True
            try:
                async for data in decode:
                    event = _check(messages.decode(data))
                    if first:
                        first = False
                        event = dataclasses.replace(event, token_ids=event.token_ids[1:])
                        if not (event.token_ids or event.text or event.finished):
                            continue
                    yield event
            except _GONE as exc:      # the decode replica died mid-stream
                raise _StartOver() from exc
            decode_ended, abandoned = True, False
        finally:
            if not decode_ended:      # the reservation (or the stream) is no longer wanted
                _cancel(decode)
            if abandoned and prefill is not None:   # client gone, deadline or failure
                _cancel(prefill)

    async def _reservation(self, decode) -> bytes:
        """The decode stream's first message (step 1). A prefill pool that may be at zero is woken
        (router/wake.py) only when that message is slow to come, as from a decode pool starting
        from zero too: from a running decode replica it comes within a step, and then a hand-off's
        own prefill call wakes the pool, while a local prefill needs no prefill replica at all."""
        waker = self.prefill_waker
        if waker is not None:
            waker.refresh()
        if waker is None or waker.may_be_at_zero is False:      # a pool that keeps a replica: no timer
            return await decode.__anext__()
        nxt = asyncio.ensure_future(decode.__anext__())
        try:
            await asyncio.wait({nxt}, timeout=WAKE_AFTER_S)
            if not nxt.done():
                waker.poke()
            return await nxt
        finally:
            _abandon(nxt)             # the request was cancelled meanwhile

    def _follow(self, prefill) -> asyncio.Task:
        """Read the rest of a prefill stream (the push's end) in the background: the call ends
        when its push does, so Serve never cuts a push when it drains the replica. The task's
        result: when the push is lost, what to raise: a `_StartOver` when the replica died, a
        RequestFailed (502) when its HandoffDone says the push failed; else None."""
        async def drain() -> Exception | None:
            lost = None
            try:
                async for data in prefill:
                    end = messages.decode(data)
                    if isinstance(end, messages.HandoffDone) and not end.ok:
                        lost = RequestFailed(502, f"KV transfer failed: {end.error}")
            except _GONE:
                return _start_over(RequestFailed(
                    503, "the prefill replica failed during the KV hand-off; retry the request"))
            except (Exception, asyncio.CancelledError):  # noqa: BLE001 - cancelled (the request ended), or a
                pass                                     # malformed message: the decode side decides
            return lost
        task = asyncio.ensure_future(drain())
        self._followers.add(task)
        task.add_done_callback(self._followers.discard)
        return task

    async def _landing(self, decode, follower: asyncio.Task) -> None:
        """Wait for the decode stream's `Landed` (step 4). If the prefill side loses the push
        first (`follower`'s result), give a `Landed`, or the decode side's own error, already on
        its way HANDOFF_GRACE_S, then fail with the follower's error; the caller's `finally`
        drops the reservation."""
        nxt = asyncio.ensure_future(decode.__anext__())
        try:
            await asyncio.wait({nxt, follower}, return_when=asyncio.FIRST_COMPLETED)
            lost = None if nxt.done() or follower.cancelled() else follower.result()
            if lost is not None:
                await asyncio.wait({nxt}, timeout=HANDOFF_GRACE_S)
                if not nxt.done():
                    raise lost
            try:
                event = _check(messages.decode(await nxt))
            except StopAsyncIteration:
                raise RequestFailed(502, "the decode replica ended the request before its K/V landed") from None
            except _GONE as exc:          # the decode replica died before the K/V landed
                raise _StartOver() from exc
        finally:
            _abandon(nxt)
        assert isinstance(event, messages.Landed), event
