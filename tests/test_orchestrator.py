"""The orchestrator's event order in disaggregated mode, against in-process stand-ins for the two
Serve handles (the real handles and replicas are exercised end to end in test_service.py):

  * the decode call comes first: its reservation (or refusal, at once) precedes the prefill, and
    the reservation's identity (its KV address) goes to the prefill replica;
  * the first token is yielded from the prefill result before the decode replica answers, so
    TTFT does not wait for the KV transfer or the decode admission;
  * the first token the decode replica repeats is dropped, so the client sees every token and
    every character once;
  * a first token that ends the request is one final event and the reservation is cancelled;
  * a decode replica that prefills the prompt itself answers with the first token: no prefill;
  * a consumer that leaves early (client gone) cancels both replica calls (the reservation and
    the push), one that leaves during the prefill too; a prefill replica that dies before its
    first token is retried with a fresh id and reservation, a replica that dies after tokens went
    out (the prefill during its push, the decode before `Landed` or mid-stream) moves the request
    on after them (a resumed request), a push a live replica reports failed before `Landed` fails
    the request at once (the reservation dropped), and a pool without a live replica for a few
    seconds (a redeploy) is waited for, not failed;
  * an embedding is one call to the prefill (or colocated) pool, asked again where its replica died,
    cancelled when its caller leaves.
"""

import asyncio
import gc

import pytest
from ray.exceptions import ActorDiedError
from ray.serve.exceptions import ReplicaUnavailableError, RequestCancelledError

from engine.sampling_params import SamplingParams
from router.metrics import RequestMetrics
from router.orchestrator import WAKE_AFTER_S, Orchestrator, RequestFailed
from serving import messages

ADDRESS = "127.0.0.1:1"


class FakeResponse:
    """A Serve streaming response: async-iterable, with `cancel()` (recorded)."""

    def __init__(self, source):
        self.source, self.cancelled, self.failed = source, False, None

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            return await self.source.__anext__()
        except ReplicaUnavailableError as exc:
            self.failed = exc
            raise
        except asyncio.CancelledError:    # as Serve's: a wait cut by the response's cancel() says so
            if self.cancelled:
                raise RequestCancelledError("cancelled") from None
            raise

    def cancel(self):
        # as Serve's: a response whose dispatch failed re-raises that error from cancel()
        if self.failed is not None:
            raise self.failed
        self.cancelled = True


class FakeHandle:
    """A Serve handle as the router uses it: `options(...)` (recorded in `options_asked`), then
    `remote(data)`, a FakeResponse over the subclass's `_stream(data)` (kept in `responses`)."""

    responses: list[FakeResponse]

    def options(self, **options):
        self.options_asked = {**getattr(self, "options_asked", {}), **options}
        return self

    def remote(self, data):
        self.responses.append(FakeResponse(self._stream(data)))
        return self.responses[-1]


class FakeDecode(FakeHandle):
    """`options(stream=True).generate.remote(data)`, as the router uses it. The stream answers
    Reserved at once, then Landed and `events` once `release` is set (the KV has landed)."""

    def __init__(self, events, log: list | None = None):
        self.events, self.requests, self.release = events, [], asyncio.Event()
        self.generate = self
        self.cached_blocks = 0        # lead blocks its prefix cache holds (Reserved.cached_blocks)
        self.responses: list[FakeResponse] = []
        self.log = log if log is not None else []

    async def _stream(self, data):
        req = messages.decode(data, expect=messages.DecodeRequest)
        self.requests.append(req)
        self.log.append("decode")
        yield messages.encode(messages.Reserved(req.request_id, ADDRESS, 1, self.cached_blocks))
        await self.release.wait()                 # the test decides when the KV lands
        yield messages.encode(messages.Landed(req.request_id))
        for event in self.events:
            yield messages.encode(event)


class FakePrefill(FakeHandle):
    """`options(stream=True).prefill.remote(data)`: a stream of the PrefillResult (after `delay`)
    then, unless it ends the request, a HandoffDone. `die` calls fail before their first token;
    with `die_pushing` a call fails after it, before its push's end; `push_error` makes its
    HandoffDone report a failed push."""

    def __init__(self, result, delay: float = 0.0, log: list | None = None, die: int = 0, die_pushing: bool = False,
                 push_error: str = ""):
        self.result, self.delay, self.die, self.die_pushing = result, delay, die, die_pushing
        self.push_error = push_error
        self.requests, self.responses = [], []
        self.log = log if log is not None else []
        self.prefill = self.embed = self

    async def _stream(self, data):
        req = messages.decode(data, expect=messages.PrefillRequest)
        self.requests.append(req)
        self.log.append("prefill")
        await asyncio.sleep(self.delay)
        if self.die:
            self.die -= 1
            raise ActorDiedError()
        yield messages.encode(self.result)
        if self.die_pushing:                      # the replica dies during its push
            raise ActorDiedError()
        if self.result.finish_reason is None:
            yield messages.encode(messages.HandoffDone(req.request_id, not self.push_error, self.push_error))


def test_reservation_first_then_the_first_token_before_decode_answers(monkeypatch):
    from serving import ray_compat
    monkeypatch.setattr(ray_compat.serve_constants, "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH", 2**31 - 1)

    async def main():
        log = []
        result = messages.PrefillResult("r", first_token=7, first_text="Hel", prefill_seconds=0.1)
        decode = FakeDecode([
            messages.TokenEvent("r", (7,), "", False, None, 3, 1),           # repeats the first token
            messages.TokenEvent("r", (8,), "lo", False, None, 3, 2),
            messages.TokenEvent("r", (9,), "!", True, "length", 3, 3),
        ], log)
        decode.cached_blocks = 2
        prefill = FakePrefill(result, log=log)
        events = Orchestrator("disaggregated", prefill, decode).run("r", [1, 2, 3], SamplingParams(max_tokens=3),
                                                                    lambda: log.append("ready"))
        first = await asyncio.wait_for(events.__anext__(), 5)   # the KV has not landed yet
        assert (first.token_ids, first.text, first.finished) == ((7,), "Hel", False)
        assert log == ["decode", "prefill"] and prefill.requests[0].kv_address == ADDRESS
        assert prefill.requests[0].skip_blocks == 2     # what the decode replica holds is not pushed
        decode.release.set()
        rest = [ev async for ev in events]
        assert log == ["decode", "prefill", "ready"]    # once its K/V landed
        assert [ev.token_ids for ev in rest] == [(8,), (9,)]
        assert first.text + "".join(ev.text for ev in rest) == "Hello!"
        assert rest[-1].finished and rest[-1].num_output_tokens == 3
        assert not decode.responses[0].cancelled and not prefill.responses[0].cancelled
        # both streams over Serve's gRPC transport (serving/ray_compat.direct_stream) where it takes
        # the largest message (the environment pdserve starts nodes with)
        assert decode.options_asked == prefill.options_asked == {"stream": True, "_by_reference": False}
    asyncio.run(main())


class LocalDecode(FakeDecode):
    """A decode replica that prefills the prompt itself (`routing.local_prefill_tokens`): its stream's
    first event is the first token, no Reserved, no Landed; it stops after `stop_after` events until
    `release` is set."""

    stop_after = None

    async def _stream(self, data):
        req = messages.decode(data, expect=messages.DecodeRequest)
        self.requests.append(req)
        self.log.append("decode")
        for i, event in enumerate(self.events):
            if i == self.stop_after:
                await self.release.wait()
            yield messages.encode(event)


def test_a_prompt_the_decode_replica_prefills_itself_never_reaches_the_prefill_pool():
    """The decode stream's first event is a token (not `Reserved`): every event goes to the client
    as it is (the first is not a repeat to drop), `ready` is called at it (the K/V is there) and no
    prefill is asked for; a consumer leaving early cancels the decode stream (the replica aborts the
    request, freeing its blocks). The SLO window counts it, with the prompt tokens it computed."""
    async def main():
        log = []
        tokens = [messages.TokenEvent("r", (7,), "Hel", False, None, 3, 1, 2),
                  messages.TokenEvent("r", (8,), "lo", False, None, 3, 2),
                  messages.TokenEvent("r", (9,), "!", True, "length", 3, 3)]
        decode, prefill, metrics = LocalDecode(tokens, log), FakePrefill(None, log=log), RequestMetrics()
        events = [ev async for ev in Orchestrator("disaggregated", prefill, decode, metrics=metrics).run(
            "r", [1, 2, 3], SamplingParams(max_tokens=3), lambda: log.append("ready"))]
        assert events == tokens and log == ["decode", "ready"] and not prefill.requests
        assert not decode.responses[0].cancelled
        assert [n for _, n in metrics.window.locals] == [1]     # 3 prompt tokens, 2 of them cached

        decode = LocalDecode(tokens, log)
        decode.stop_after = 1
        events = Orchestrator("disaggregated", prefill, decode).run("r2", [1, 2, 3], SamplingParams(max_tokens=3))
        assert (await asyncio.wait_for(events.__anext__(), 5)).token_ids == (7,)
        await events.aclose()                     # the client left
        assert decode.responses[0].cancelled and not prefill.requests
    asyncio.run(main())


def test_a_prefill_pool_that_scales_to_zero_is_woken_when_the_reservation_is_slow():
    """With `wake_prefill` (a prefill pool whose min_replicas is 0) a hand-off whose reservation has
    not come within WAKE_AFTER_S (a decode pool starting from zero) sends the prefill pool a
    `stats` call before its prefill can be routed, so that Serve sees a request waiting there and
    starts both pools at once (router/wake.py); at most one a second. A reservation that comes at
    once (a running decode replica: its prefill call, if any, wakes the pool) and `wake_prefill`
    off send none."""
    async def main():
        log = []

        class Stats:
            def remote(self):
                log.append("stats")
                done = asyncio.get_running_loop().create_future()
                done.set_result(b"")
                return done

        class SlowDecode(FakeDecode):
            async def _stream(self, data):
                await asyncio.sleep(WAKE_AFTER_S + 0.2)          # a decode replica starting
                async for message in super()._stream(data):
                    yield message

        result = messages.PrefillResult("r", first_token=7, first_text="a", prefill_seconds=0.1)
        for wake, slow in ((True, True), (True, False), (False, True)):
            log.clear()
            decode = (SlowDecode if slow else FakeDecode)([
                messages.TokenEvent("r", (7,), "", False, None, 2, 1),      # the first again
                messages.TokenEvent("r", (8,), "b", True, "length", 2, 2)], log)
            decode.release.set()
            prefill = FakePrefill(result, log=log)
            prefill.stats = Stats()
            orchestrator = Orchestrator("disaggregated", prefill, decode, wake_prefill=wake)
            for rid in ("r1", "r2"):
                events = [ev async for ev in orchestrator.run(rid, [1, 2], SamplingParams(max_tokens=2))]
                assert [ev.token_ids for ev in events] == [(7,), (8,)]
            if wake and slow:          # r2's poke comes within a second of r1's (on a slow host, not)
                assert 1 <= log.count("stats") <= 2 and log.index("stats") < log.index("prefill"), log
            else:
                assert "stats" not in log, (wake, slow, log)
    asyncio.run(main())


def test_the_waker_pokes_only_a_pool_that_serve_says_may_be_at_zero(monkeypatch):
    """The waker asks Serve (in the background, every check_s) whether its pool runs with
    min_replicas 0 (`refresh`, at every hand-off, and `poke`) and sends no call while the answer is
    no: an app whose pools keep a replica pays nothing for it."""
    from types import SimpleNamespace

    from router import wake
    monkeypatch.setattr(wake.serve, "get_replica_context", lambda: SimpleNamespace(app_name="app"))
    zero = {"app": set()}
    monkeypatch.setattr(wake, "scales_to_zero", lambda app: zero[app])

    async def main():
        calls = []

        class Stats:
            def remote(self):
                calls.append(1)
                done = asyncio.get_running_loop().create_future()
                done.set_result(b"")
                return done
        waker = wake.PoolWaker(SimpleNamespace(deployment_name="PrefillServer", stats=Stats()), every_s=0,
                               check_s=0.2)
        waker.poke()                    # not asked yet: a call, and Serve is asked
        await asyncio.sleep(0.05)
        assert waker.may_be_at_zero is False and len(calls) == 1
        waker.poke()
        assert len(calls) == 1
        zero["app"] = {"PrefillServer"}           # a deploy made it min_replicas 0
        await asyncio.sleep(0.2)
        waker.refresh()                 # every hand-off: asked again, no call
        await asyncio.sleep(0.05)
        assert waker.may_be_at_zero is True and len(calls) == 1
        waker.poke()
        assert len(calls) == 2
    asyncio.run(main())


def test_first_token_that_ends_the_request_drops_the_reservation():
    async def main():
        result = messages.PrefillResult("r", first_token=0, finish_reason="stop", first_text="")
        decode, prefill = FakeDecode([]), FakePrefill(result)
        events = [ev async for ev in Orchestrator("disaggregated", prefill, decode).run(
            "r", [1, 2], SamplingParams(max_tokens=5))]
        assert len(events) == 1 and events[0].finished and events[0].finish_reason == "stop"
        assert decode.responses[0].cancelled and not prefill.responses[0].cancelled
    asyncio.run(main())


@pytest.mark.parametrize("refusal", ["out of blocks", "replica gone"])
def test_a_refused_or_missing_reservation_fails_before_any_prefill(refusal):
    """Out of KV blocks is a 503 at once; Serve raises ReplicaUnavailableError (not a RayError)
    when the chosen replica died before the dispatch: a 503 too, not a cut connection."""
    from ray.serve.exceptions import ReplicaUnavailableError

    class Refusing(FakeDecode):
        async def _stream(self, data):
            if refusal == "replica gone":
                raise ReplicaUnavailableError("decode#1")
            yield messages.encode(messages.ErrorEvent("r", "decode replica is out of KV blocks", 503, "overloaded"))

    async def main():
        prefill = FakePrefill(messages.PrefillResult("r", first_token=7, first_text="Hi"))
        metrics = RequestMetrics()
        events = Orchestrator("disaggregated", prefill, Refusing([]), metrics=metrics,
                              retry_delays_s=(0, 0.01, 0.01)).run("r", [1, 2, 3], SamplingParams(max_tokens=3))
        with pytest.raises(RequestFailed) as failed:
            await events.__anext__()
        assert failed.value.code == 503 and prefill.requests == []
        # out of KV is the SLO policy's decode backlog signal; a replica gone (retried, then 503) is not
        assert len(metrics.window.refusals) == (1 if refusal == "out of blocks" else 0)
    asyncio.run(main())


def test_leaving_early_cancels_both_replica_calls():
    async def main():
        result = messages.PrefillResult("r", first_token=7, first_text="Hi")
        decode = FakeDecode([messages.TokenEvent("r", (7,), "", False, None, 3, 1)]
                            + [messages.TokenEvent("r", (8,), "x", False, None, 3, 2)] * 5)
        decode.release.set()
        prefill = FakePrefill(result)
        events = Orchestrator("disaggregated", prefill, decode).run("r", [1, 2, 3], SamplingParams(max_tokens=50))
        await events.__anext__()                # the first token
        await events.__anext__()                # one from the decode stream
        await events.aclose()                   # the client is gone
        assert decode.responses[0].cancelled and prefill.responses[0].cancelled

        slow_decode, slow = FakeDecode([]), FakePrefill(result, delay=10)
        task = asyncio.ensure_future(Orchestrator("disaggregated", slow, slow_decode).run(
            "s", [1, 2], SamplingParams(max_tokens=5)).__anext__())
        await asyncio.sleep(0.05)
        task.cancel()                           # the client left during the prefill
        await asyncio.gather(task, return_exceptions=True)
        assert slow.responses[0].cancelled and slow_decode.responses[0].cancelled
    asyncio.run(main())


def test_a_prefill_replica_dying_before_its_first_token_is_retried_with_a_fresh_reservation():
    async def main():
        result = messages.PrefillResult("r-retry1", first_token=0, finish_reason="length", first_text="x")
        decode, prefill = FakeDecode([]), FakePrefill(result, die=1)
        events = [ev async for ev in Orchestrator("disaggregated", prefill, decode).run(
            "r", [1, 2], SamplingParams(max_tokens=1))]
        assert events[-1].finished and [r.request_id for r in decode.requests] == ["r", "r-retry1"]
        assert [r.request_id for r in prefill.requests] == ["r", "r-retry1"]
        assert decode.responses[0].cancelled    # the first reservation is dropped at once
    asyncio.run(main())


def test_a_push_reported_failed_before_it_landed_fails_the_request_at_once_and_drops_the_reservation(monkeypatch):
    """The first token has reached the client, and the live prefill replica reports its push failed
    (e.g. no pair within the connect timeout, which the decode side never hears of): the request
    fails after the grace for a `Landed` on its way, not after the decode reservation's lease, and
    is not moved (a transfer that fails between live replicas would likely fail again)."""
    from router import orchestrator
    monkeypatch.setattr(orchestrator, "HANDOFF_GRACE_S", 0.2)

    async def main():
        unretrieved = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: unretrieved.append(context))
        result = messages.PrefillResult("r", first_token=7, first_text="Hi")
        decode = FakeDecode([messages.TokenEvent("r", (7,), "", False, None, 2, 1)])   # never released
        prefill = FakePrefill(result, push_error="connect timeout")
        events = Orchestrator("disaggregated", prefill, decode).run("r", [1, 2], SamplingParams(max_tokens=5))
        first = await asyncio.wait_for(events.__anext__(), 5)
        assert first.token_ids == (7,)
        with pytest.raises(RequestFailed) as failed:
            await asyncio.wait_for(events.__anext__(), 5)
        assert failed.value.code == 502 and "connect timeout" in failed.value.message
        assert decode.responses[0].cancelled    # the reservation is dropped now
        assert len(prefill.requests) == 1
        # the wait for `Landed`, cut, ended in the handle's RequestCancelledError: nobody left it unretrieved
        del failed
        await asyncio.sleep(0.05)
        gc.collect()
        assert not unretrieved, unretrieved
    asyncio.run(main())


class MigratingDecode(FakeDecode):
    """The decode pool over two attempts: attempt 1 ("r") fails as `how` says (after its stream
    gave 8 (" there") when the decode replica dies mid-stream); attempt 2 ("r-retry1", resumed)
    repeats the prefill's 9, then ends with 10 ("!")."""

    def __init__(self, how: str):
        super().__init__([])
        self.how = how

    async def _stream(self, data):
        req = messages.decode(data, expect=messages.DecodeRequest)
        self.requests.append(req)
        yield messages.encode(messages.Reserved(req.request_id, ADDRESS, 1))
        if req.request_id == "r":
            if self.how == "prefill died pushing":
                await asyncio.sleep(60)           # the push never lands
            if self.how == "decode died before landing":
                await asyncio.sleep(0.05)
                raise ActorDiedError()
            yield messages.encode(messages.Landed(req.request_id))
            yield messages.encode(messages.TokenEvent("r", (7, 8), " there", False, None, 2, 2))
            await asyncio.sleep(0.05)
            raise ActorDiedError()                # "decode died mid-stream", after 8 went out
        yield messages.encode(messages.Landed(req.request_id))
        n = len(req.resumed_token_ids)
        yield messages.encode(messages.TokenEvent(req.request_id, (9,), "", False, None, 2, n + 1))
        yield messages.encode(messages.TokenEvent(req.request_id, (10,), "!", True, "length", 2, n + 2))


class MigratingPrefill(FakePrefill):
    """The prefill pool over two attempts: attempt 1 gives the first token 7 ("Hi", with prompt
    logprobs) and, when `how` says so, dies during its push; attempt 2 gives 9 (" you")."""

    def __init__(self, how: str):
        super().__init__(None)
        self.how = how

    async def _stream(self, data):
        req = messages.decode(data, expect=messages.PrefillRequest)
        self.requests.append(req)
        if req.request_id == "r":
            yield messages.encode(messages.PrefillResult("r", first_token=7, first_text="Hi",
                                                         prompt_logprobs=(messages.TokenLogprobs(2, -1.0),)))
            if self.how == "prefill died pushing":
                raise ActorDiedError()
        else:
            yield messages.encode(messages.PrefillResult(req.request_id, first_token=9, first_text=" you"))
        yield messages.encode(messages.HandoffDone(req.request_id, True))


async def _collect(events):
    return [ev async for ev in events]


@pytest.mark.parametrize("how", ["prefill died pushing", "decode died before landing", "decode died mid-stream"])
def test_a_replica_dying_after_tokens_went_out_moves_the_request_on_after_them(monkeypatch, how):
    """Migration: the request starts over as a resumed one (the prompt plus the tokens the client
    has, and how many characters of their text it was shown; no prompt logprobs again), the old
    reservation and calls are dropped, and the client's stream goes on with the new tokens only,
    their counts the whole request's."""
    from router import orchestrator
    monkeypatch.setattr(orchestrator, "HANDOFF_GRACE_S", 0.2)

    async def main():
        decode, prefill, metrics = MigratingDecode(how), MigratingPrefill(how), RequestMetrics()
        # the move follows at once (the delay before the second attempt is for pools with no live replica)
        orch = Orchestrator("disaggregated", prefill, decode, metrics=metrics, retry_delays_s=(0, 30.0, 0.01))
        params = SamplingParams(max_tokens=5, prompt_logprobs=1)
        events = await asyncio.wait_for(_collect(orch.run("r", [1, 2], params)), 5)
        out = [t for ev in events for t in ev.token_ids]
        text = "".join(ev.text for ev in events)
        before = (7, 8) if how == "decode died mid-stream" else (7,)
        shown = "Hi there" if how == "decode died mid-stream" else "Hi"
        assert out == [*before, 9, 10] and text == shown + " you!"
        assert events[-1].finished and events[-1].num_output_tokens == len(before) + 2
        assert [r.request_id for r in decode.requests] == ["r", "r-retry1"]
        retry_prefill, retry_decode = prefill.requests[1], decode.requests[1]
        assert retry_prefill.resumed_token_ids == retry_decode.resumed_token_ids == before
        assert retry_prefill.shown_chars == len(shown) and retry_prefill.params.prompt_logprobs is None
        assert decode.requests[0].params.prompt_logprobs == 1
        resumed_first = next(ev for ev in events if ev.token_ids == (9,))
        assert resumed_first.num_output_tokens == len(before) + 1 and not resumed_first.prompt_logprobs
        if how == "prefill died pushing":
            assert decode.responses[0].cancelled   # the old reservation is dropped
        assert metrics.migrations == 1 and "pdserve_request_migrations_total 1" in metrics.lines()
    asyncio.run(main())


def test_a_replica_that_keeps_dying_fails_the_request_once_the_attempts_are_spent():
    class AlwaysDying(FakeDecode):
        async def _stream(self, data):
            req = messages.decode(data, expect=messages.DecodeRequest)
            yield messages.encode(messages.Reserved(req.request_id, ADDRESS, 1))
            yield messages.encode(messages.Landed(req.request_id))
            raise ActorDiedError()

    class OneTokenEach(FakePrefill):
        async def _stream(self, data):
            req = messages.decode(data, expect=messages.PrefillRequest)
            self.requests.append(req)
            yield messages.encode(messages.PrefillResult(req.request_id, first_token=5 + len(req.resumed_token_ids),
                                                         first_text="a"))
            yield messages.encode(messages.HandoffDone(req.request_id, True))

    async def main():
        prefill = OneTokenEach(None)
        got = []
        with pytest.raises(RequestFailed) as failed:
            async for ev in Orchestrator("disaggregated", prefill, AlwaysDying([]), retry_delays_s=(0, 0.01, 0.01)).run(
                    "r", [1, 2], SamplingParams(max_tokens=50)):
                got += ev.token_ids
        assert failed.value.code == 503 and got == [5, 6, 7]      # one token per attempt, then the end
        assert [r.resumed_token_ids for r in prefill.requests] == [(), (5,), (5, 6)]
    asyncio.run(main())


def test_colocated_a_replica_dying_mid_stream_moves_the_request_on_after_its_tokens():
    class Colocated(FakeHandle):
        def __init__(self):
            self.requests, self.responses, self.generate, self.embed = [], [], self, self

        async def _stream(self, data):
            req = messages.decode(data, expect=messages.GenerateRequest)
            self.requests.append(req)
            # each attempt counts its own drafts from a predicted output (accepted, rejected)
            if not req.resumed_token_ids:
                yield messages.encode(messages.TokenEvent(req.request_id, (4, 5), "ab", False, None, 2, 2,
                                                          accepted_prediction_tokens=1, rejected_prediction_tokens=3))
                raise ActorDiedError()
            yield messages.encode(messages.TokenEvent(req.request_id, (6,), "c", False, None, 2, 3,
                                                      accepted_prediction_tokens=2))
            yield messages.encode(messages.TokenEvent(req.request_id, (7,), "d", True, "length", 2, 4,
                                                      accepted_prediction_tokens=2, rejected_prediction_tokens=1))

    async def main():
        pool = Colocated()
        events = [ev async for ev in Orchestrator("colocated", colocated=pool, retry_delays_s=(0, 0.01)).run(
            "r", [1, 2], SamplingParams(max_tokens=4))]
        assert [t for ev in events for t in ev.token_ids] == [4, 5, 6, 7]
        assert "".join(ev.text for ev in events) == "abcd"
        assert [(r.request_id, r.resumed_token_ids, r.shown_chars) for r in pool.requests] == [
            ("r", (), 0), ("r-retry1", (4, 5), 2)]
        # the usage's prediction counts are the whole request's: the moved request's add to the first attempt's
        assert [(ev.accepted_prediction_tokens, ev.rejected_prediction_tokens) for ev in events] == [
            (1, 3), (3, 3), (3, 4)]
    asyncio.run(main())


def test_a_prefill_replica_dying_after_its_push_landed_does_not_fail_the_request():
    """The push landed (the decode stream's `Landed` may even arrive after the prefill stream's
    error): the request goes on from the decode replica."""
    async def main():
        result = messages.PrefillResult("r", first_token=7, first_text="Hi")
        decode = FakeDecode([messages.TokenEvent("r", (7, 8), "!", True, "length", 2, 2)])
        decode.release.set()
        prefill = FakePrefill(result, die_pushing=True)
        events = [ev async for ev in Orchestrator("disaggregated", prefill, decode).run(
            "r", [1, 2], SamplingParams(max_tokens=2))]
        assert [ev.token_ids for ev in events] == [(7,), (8,)] and events[-1].finished
        assert not decode.responses[0].cancelled
    asyncio.run(main())


def test_a_decode_replica_removed_before_the_dispatch_is_retried_on_a_fresh_reservation():
    """Serve may remove a replica between choosing it and dispatching to it (scale-down):
    nothing was produced yet, so the request starts over."""
    from ray.serve.exceptions import ReplicaUnavailableError

    class GoneOnce(FakeDecode):
        async def _stream(self, data):
            if not self.requests:
                self.requests.append(None)
                raise ReplicaUnavailableError("decode#1")
            async for event in super()._stream(data):
                yield event

    async def main():
        result = messages.PrefillResult("r-retry1", first_token=0, finish_reason="length", first_text="x")
        decode, prefill = GoneOnce([]), FakePrefill(result)
        events = [ev async for ev in Orchestrator("disaggregated", prefill, decode).run(
            "r", [1, 2], SamplingParams(max_tokens=1))]
        assert events[-1].finished and [r.request_id for r in prefill.requests] == ["r-retry1"]
    asyncio.run(main())


def test_a_decode_pool_without_a_live_replica_for_a_while_is_waited_for():
    """A redeploy stops a pool's old replica before its new one serves, and meanwhile the handle
    still offers the old one (ReplicaUnavailableError at each dispatch): the request starts over
    after growing delays instead of failing, and a request that never finds one fails with a 503
    once they are spent."""
    from ray.serve.exceptions import ReplicaUnavailableError

    class GoneUntil(FakeDecode):
        def __init__(self, events, back_at):
            super().__init__(events)
            self.back_at, self.tries = back_at, []

        async def _stream(self, data):
            self.tries.append(asyncio.get_running_loop().time())
            if self.tries[-1] < self.back_at:
                raise ReplicaUnavailableError("decode#old")
            async for event in super()._stream(data):
                yield event

    async def main():
        loop = asyncio.get_running_loop()
        result = messages.PrefillResult("r-retry3", first_token=0, finish_reason="length", first_text="x")
        decode, prefill = GoneUntil([], back_at=loop.time() + 0.3), FakePrefill(result)
        events = [ev async for ev in Orchestrator("disaggregated", prefill, decode,
                                                  retry_delays_s=(0, 0.1, 0.1, 0.2, 0.4)).run(
            "r", [1, 2], SamplingParams(max_tokens=1))]
        assert events[-1].finished and len(decode.tries) == 4
        assert [r.request_id for r in prefill.requests] == ["r-retry3"]
        never = GoneUntil([], back_at=loop.time() + 60)
        with pytest.raises(RequestFailed) as failed:
            await Orchestrator("disaggregated", FakePrefill(result), never,
                               retry_delays_s=(0, 0.01, 0.01)).run("s", [1, 2], SamplingParams(max_tokens=1)).__anext__()
        assert failed.value.code == 503 and len(never.tries) == 3
    asyncio.run(main())


def test_every_sampled_choice_gets_a_seed_so_that_a_moved_request_draws_what_it_would_have():
    """router/choice_view.py `choice_params`: a sampled request without a seed gets one before its first
    attempt (each choice its own), so its resumed attempts after a replica died draw the same random
    stream (the engine's exactness for seeded resumed requests: test_engine_exact); seeded choices
    get seed + j; greedy requests stay unseeded."""
    from router.choice_view import choice_params
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=0.8)
    assert choice_params(greedy, 0) is greedy and choice_params(greedy, 3).seed is None
    seeds = {choice_params(sampled, j).seed for j in (0, 0, 1)}
    assert len(seeds) == 3 and all(0 <= s < 2**63 for s in seeds)
    seeded = SamplingParams(temperature=0.8, seed=2**63 - 1)
    assert choice_params(seeded, 0) is seeded and choice_params(seeded, 2).seed == 1


class FakeEmbedder(FakeHandle):
    """`options(stream=True).embed.remote(data)`: a stream of one Embedded (after `delay`); the first
    `die` calls fail before it, as a dead replica's."""

    def __init__(self, die: int = 0, delay: float = 0.0):
        self.die, self.delay, self.requests, self.responses = die, delay, [], []
        self.embed = self.prefill = self.generate = self

    async def _stream(self, data):
        req = messages.decode(data, expect=messages.EmbedRequest)
        self.requests.append(req)
        await asyncio.sleep(self.delay)
        if self.die:
            self.die -= 1
            raise ActorDiedError()
        yield messages.encode(messages.Embedded(req.request_id, (b"\0" * 8,) * len(req.prompts),
                                                sum(map(len, req.prompts))))


def test_an_embedding_is_one_call_to_the_prefill_pool_asked_again_where_its_replica_died():
    from engine.pooling import Pooling
    params = SamplingParams(pooling=Pooling("mean", False, 2))

    async def main():
        pool, decode = FakeEmbedder(die=1), FakeDecode([])
        answer = await Orchestrator("disaggregated", pool, decode, retry_delays_s=(0, 0.01)).embed(
            "e", [[1, 2], [3]], params)
        assert answer == messages.Embedded("e-retry1", (b"\0" * 8,) * 2, 3) and not decode.requests
        assert pool.requests[1].prompts == ((1, 2), (3,))
        assert [r.request_id for r in pool.requests] == ["e", "e-retry1"]
        assert pool.requests[0].params.to_params().pooling == Pooling("mean", False, 2)
        with pytest.raises(RequestFailed) as failed:            # dead every time: a 503 once the attempts are spent
            dead = Orchestrator("colocated", colocated=FakeEmbedder(die=3), retry_delays_s=(0, 0.01))
            await dead.embed("e", [[1]], params)
        assert failed.value.code == 503
        slow = FakeEmbedder(delay=10)                            # the caller leaves: the call is cancelled
        task = asyncio.ensure_future(Orchestrator("colocated", colocated=slow).embed("e", [[1]], params))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert slow.responses[0].cancelled
    asyncio.run(main())
