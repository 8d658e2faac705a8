"""The orchestrator's event order in disaggregated mode, against in-process stand-ins for the two
Serve handles (the real handles and replicas are exercised end to end in test_service.py):

  * the first token is yielded from the prefill result before the decode call is made, so TTFT
    does not wait for the KV transfer or the decode replica;
  * the decode replica is told how much text the client already has, and the first token it
    repeats is dropped, so the client sees every token and every character once;
  * a first token that ends the request is one final event and no decode call is made;
  * a consumer that leaves early (client gone) cancels the decode call on its replica, and one
    that leaves during the prefill cancels the prefill call.
"""

import asyncio
import contextlib
import types

from engine.sampling_params import SamplingParams
from router.orchestrator import Orchestrator
from serving import messages


class FakeResponse:
    """A Serve response: awaitable or async-iterable, with `cancel()` (recorded)."""

    def __init__(self, source):
        self.source, self.cancelled = source, False

    def __await__(self):
        return self.source.__await__()

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.source.__anext__()

    def cancel(self):
        self.cancelled = True


class FakeDecode:
    """`options(stream=True)`, its `.generate.choose_replica()` and `.dispatch()`, as the router
    uses them."""

    def __init__(self, events):
        self.events, self.requests, self.release = events, [], asyncio.Event()
        self.generate = self
        self.responses: list[FakeResponse] = []

    def options(self, stream):
        return self

    @contextlib.asynccontextmanager
    async def choose_replica(self):
        yield types.SimpleNamespace(replica_metadata={"kv_address": "127.0.0.1:1"})

    def dispatch(self, selection, data):
        self.responses.append(FakeResponse(self._stream(data)))
        return self.responses[-1]

    async def _stream(self, data):
        self.requests.append(messages.decode(data, expect=messages.DecodeRequest))
        await self.release.wait()                 # the test decides when the decode replica answers
        for event in self.events:
            yield messages.encode(event)


def fake_prefill(result, delay: float = 0.0, calls: list | None = None):
    async def answer():
        await asyncio.sleep(delay)
        return messages.encode(result)

    def remote(data):
        response = FakeResponse(answer())
        if calls is not None:
            calls.append(response)
        return response
    return types.SimpleNamespace(prefill=types.SimpleNamespace(remote=remote))


def test_first_token_comes_before_decode_and_is_not_repeated():
    async def main():
        result = messages.PrefillResult("r", first_token=7, first_text="Hel", prefill_seconds=0.1)
        decode = FakeDecode([
            messages.TokenEvent("r", (7,), "", False, None, 3, 1),           # repeats the first token
            messages.TokenEvent("r", (8,), "lo", False, None, 3, 2),
            messages.TokenEvent("r", (9,), "!", True, "length", 3, 3),
        ])
        orch = Orchestrator("disaggregated", fake_prefill(result), decode)
        events = orch.run("r", [1, 2, 3], SamplingParams(max_tokens=3))
        first = await asyncio.wait_for(events.__anext__(), 5)   # the decode replica has not answered
        assert (first.token_ids, first.text, first.finished) == ((7,), "Hel", False)
        decode.release.set()
        rest = [ev async for ev in events]
        assert decode.requests[0].shown_chars == 3 and decode.requests[0].first_token == 7
        assert [ev.token_ids for ev in rest] == [(8,), (9,)]
        assert first.text + "".join(ev.text for ev in rest) == "Hello!"
        assert rest[-1].finished and rest[-1].num_output_tokens == 3
    asyncio.run(main())


def test_first_token_that_ends_the_request_skips_decode():
    async def main():
        result = messages.PrefillResult("r", first_token=0, finish_reason="stop", first_text="")
        decode = FakeDecode([])
        orch = Orchestrator("disaggregated", fake_prefill(result), decode)
        events = [ev async for ev in orch.run("r", [1, 2], SamplingParams(max_tokens=5))]
        assert len(events) == 1 and events[0].finished and events[0].finish_reason == "stop"
        assert decode.requests == []
    asyncio.run(main())


def test_decode_replica_gone_after_the_first_token_is_a_503():
    """Serve raises ReplicaUnavailableError (not a RayError) when the chosen replica died before
    the dispatch: the stream must end with a 503, not a cut connection."""
    from ray.serve.exceptions import ReplicaUnavailableError

    from router.orchestrator import RequestFailed

    class GoneDecode(FakeDecode):
        async def _stream(self, data):
            raise ReplicaUnavailableError("decode#1")
            yield  # an async generator, like the real stream

    async def main():
        result = messages.PrefillResult("r", first_token=7, first_text="Hi")
        events = Orchestrator("disaggregated", fake_prefill(result), GoneDecode([])).run(
            "r", [1, 2, 3], SamplingParams(max_tokens=3))
        assert (await events.__anext__()).text == "Hi"
        try:
            await events.__anext__()
        except RequestFailed as exc:
            assert exc.code == 503 and "ReplicaUnavailableError" in exc.message
        else:
            raise AssertionError("no failure")
    asyncio.run(main())


def test_leaving_early_cancels_the_replica_calls():
    async def main():
        result = messages.PrefillResult("r", first_token=7, first_text="Hi")
        decode = FakeDecode([messages.TokenEvent("r", (7,), "", False, None, 3, 1)]
                            + [messages.TokenEvent("r", (8,), "x", False, None, 3, 2)] * 5)
        decode.release.set()
        events = Orchestrator("disaggregated", fake_prefill(result), decode).run(
            "r", [1, 2, 3], SamplingParams(max_tokens=50))
        await events.__anext__()                # the first token
        await events.__anext__()                # one from the decode stream
        await events.aclose()                   # the client is gone
        assert decode.responses[0].cancelled

        calls = []
        slow = Orchestrator("disaggregated", fake_prefill(result, delay=10, calls=calls), FakeDecode([]))
        task = asyncio.ensure_future(slow.run("s", [1, 2], SamplingParams(max_tokens=5)).__anext__())
        await asyncio.sleep(0.05)
        task.cancel()                           # the client left during the prefill
        await asyncio.gather(task, return_exceptions=True)
        assert calls[0].cancelled

        finished = FakeDecode([messages.TokenEvent("r", (9,), "!", True, "length", 3, 2)])
        finished.release.set()
        done = [ev async for ev in Orchestrator("disaggregated", fake_prefill(result), finished).run(
            "r", [1, 2, 3], SamplingParams(max_tokens=2))]
        assert done[-1].finished and not finished.responses[0].cancelled   # a finished stream is left alone
    asyncio.run(main())
