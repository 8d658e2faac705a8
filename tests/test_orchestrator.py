"""The orchestrator's event order in disaggregated mode, against in-process stand-ins for the two
Serve handles (the real handles and replicas are exercised end to end in test_service.py):

  * the first token is yielded from the prefill result before the decode call is made, so TTFT
    does not wait for the KV transfer or the decode replica;
  * the decode replica is told how much text the client already has, and the first token it
    repeats is dropped, so the client sees every token and every character once;
  * a first token that ends the request is one final event and no decode call is made.
"""

import asyncio
import contextlib
import types

from engine.sampling_params import SamplingParams
from pdserve import messages
from router.orchestrator import Orchestrator


class FakeDecode:
    """`options(stream=True)`, its `.generate.choose_replica()` and `.dispatch()`, as the router
    uses them."""

    def __init__(self, events):
        self.events, self.requests, self.release = events, [], asyncio.Event()
        self.generate = self

    def options(self, stream):
        return self

    @contextlib.asynccontextmanager
    async def choose_replica(self):
        yield types.SimpleNamespace(replica_metadata={"kv_address": "127.0.0.1:1"})

    async def dispatch(self, selection, data):
        self.requests.append(messages.decode(data, expect=messages.DecodeRequest))
        await self.release.wait()                 # the test decides when the decode replica answers
        for event in self.events:
            yield messages.encode(event)


def fake_prefill(result):
    async def remote(data):
        return messages.encode(result)
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
        async def dispatch(self, selection, data):
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
