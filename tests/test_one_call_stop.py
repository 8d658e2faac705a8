"""parallel_tool_calls false in the syntaxes with no stop string for it (Llama 3's JSON, Mistral's and
Granite's arrays, pythonic lists): the router stops a choice once its one call is complete
(router/reply.py, `Choices.stop`), with scripted runs (no Ray) that would go on writing calls: the
run is closed there (which aborts it in the pools), the reply says "tool_calls" and counts the
tokens up to the stop, streamed and whole alike; where calls are allowed in parallel, or a choice's
output is not a call, nothing is stopped."""

import asyncio
import json

import pytest

from router.chat_output import ChatOutputShape
from router.chat_protocol import ChatCompletionRequest
from router.choices import Choices
from router.logprobs import TokenStrings
from router.metrics import RequestMetrics
from router.orchestrator import RequestFailed
from router.reply import Reply
from router.tools import GRANITE, HERMES, LLAMA3_JSON, MISTRAL, PYTHONIC
from serving.messages import TokenEvent

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CALLS = {  # syntax, an output with two calls
    "llama3": (LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                            '{"name": "get_weather", "parameters": {"city": "Rome"}}'),
    "mistral": (MISTRAL, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                         '{"name": "get_weather", "arguments": {"city": "Rome"}}]'),
    "granite": (GRANITE, '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                         '{"name": "get_weather", "arguments": {"city": "Rome"}}]'),
    "pythonic": (PYTHONIC, '[get_weather(city="Paris"), get_weather(city="Rome")]'),
}
PIECE = 4       # characters per scripted token


class Writer:
    """A run writing `text` PIECE characters a token, then (if `tail`) more tokens without end;
    `log` gets how many tokens it yielded and whether it was closed."""

    def __init__(self, text: str, log: dict, tail: bool = True):
        self.text, self.log, self.tail = text, log, tail

    async def __call__(self, ready):
        pieces = [self.text[k:k + PIECE] for k in range(0, len(self.text), PIECE)]
        try:
            k = 0
            while k < len(pieces) or self.tail:
                piece = pieces[k] if k < len(pieces) else " more"
                k += 1
                self.log["yielded"] = k
                done = not self.tail and k == len(pieces)
                yield TokenEvent("r", (k,), piece, done, "stop" if done else None, num_prompt_tokens=5,
                                 num_output_tokens=k)
                ready()
                await asyncio.sleep(0.001)
        finally:
            self.log["closed"] = True


def reply(syntax, parallel: bool, texts: list[str], stream: bool, tail: bool = True):
    """Run a chat request's reply over writers of `texts` (one per choice): (result, logs)."""
    logs = [{} for _ in texts]
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                 parallel_tool_calls=parallel, n=len(texts), stream=stream)
    shape = ChatOutputShape(tools=syntax, parallel=parallel)

    async def main():
        choices = Choices([[Writer(t, log, tail) for t, log in zip(texts, logs)]])
        firsts = await choices.start()
        r = Reply(body, "rid", "m", True, choices, firsts, (0.0, 0.0), RequestMetrics(), TokenStrings(None),
                  shape=shape)
        if not stream:
            return await asyncio.wait_for(r.collect(), 10)
        return [chunk async for chunk in r.stream()]
    return asyncio.run(main()), logs


def events(chunks: list[str]) -> list[dict]:
    assert chunks[-1] == "data: [DONE]\n\n"
    return [json.loads(c.removeprefix("data: ")) for c in chunks[:-1]]


def first_call_tokens(text: str) -> int:
    """The scripted token in which the first call is complete (its closing bracket)."""
    end = text.index(")") + 1 if text.startswith("[get") else text.index("}}") + 2
    return -(-end // PIECE)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_the_choice_stops_at_its_one_call(name):
    syntax, text = CALLS[name]
    out, logs = reply(syntax, False, [text], stream=False)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    calls = choice["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}]
    assert logs[0]["closed"] and logs[0]["yielded"] < first_call_tokens(text) + 5    # not the endless tail
    assert out["usage"]["completion_tokens"] == first_call_tokens(text)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_a_streamed_choice_stops_at_its_one_call(name):
    syntax, text = CALLS[name]
    chunks, logs = reply(syntax, False, [text], stream=True)
    evs = events(chunks)
    deltas = [d for ev in evs for c in ev["choices"] for d in c["delta"].get("tool_calls") or []]
    assert {d["index"] for d in deltas} == {0}
    assert json.loads("".join(d["function"].get("arguments", "") for d in deltas)) == {"city": "Paris"}
    finishes = [c["finish_reason"] for ev in evs for c in ev["choices"] if c["finish_reason"]]
    assert finishes == ["tool_calls"]
    assert logs[0]["closed"] and logs[0]["yielded"] < first_call_tokens(text) + 5


@pytest.mark.parametrize("name", sorted(CALLS))
def test_a_second_call_cut_off_by_the_stop_is_not_content(name):
    """The event that completes the call may carry the start of the next one (several tokens in one
    event): it is dropped with the rest, streamed or whole."""
    syntax, text = CALLS[name]
    cut = text[:first_call_tokens(text) * PIECE + 9]            # the call, then 9 characters of the next
    shape = ChatOutputShape(tools=syntax, parallel=False)
    _, content, calls = shape.choice().message(cut)
    assert content is None and len(calls) == 1
    streamed = shape.choice()
    pieces = [streamed.feed(cut[k:k + 3]) for k in range(0, len(cut), 3)] + [streamed.finish()]
    assert not "".join(p.content for p in pieces) and streamed.done


def test_only_the_choice_with_a_call_stops():
    syntax, text = CALLS["mistral"]
    out, logs = reply(syntax, False, [text, "Plain words, no call at all."], stream=False, tail=False)
    first, second = out["choices"]
    assert first["finish_reason"] == "tool_calls" and len(first["message"]["tool_calls"]) == 1
    assert second["finish_reason"] == "stop" and second["message"]["content"] == "Plain words, no call at all."
    assert logs[1]["yielded"] == -(-len("Plain words, no call at all.") // PIECE)      # ran to its end
    assert out["usage"]["completion_tokens"] == first_call_tokens(text) + logs[1]["yielded"]


@pytest.mark.parametrize("syntax", [LLAMA3_JSON, HERMES])
def test_with_parallel_calls_or_a_stop_string_nothing_stops(syntax):
    text = CALLS["llama3"][1] if syntax == LLAMA3_JSON else (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' * 2)
    parallel = syntax == LLAMA3_JSON
    out, logs = reply(syntax, parallel, [text], stream=False, tail=False)
    assert logs[0]["yielded"] == -(-len(text) // PIECE)
    # Hermes' one call is ended by the engine's stop string, which a script does not know
    assert len(out["choices"][0]["message"]["tool_calls"]) == 2


def test_a_stopped_choice_yields_nothing_more_not_even_its_failure():
    class Failing:
        def __init__(self, log):
            self.log = log

        async def __call__(self, ready):
            try:
                for k in range(3):
                    yield TokenEvent("r", (k,), str(k))
                raise RequestFailed(503, "gone")
            finally:
                self.log.append("closed")

    async def main():
        log = []
        choices = Choices([[Failing(log), Writer("abcdefgh", {}, tail=False)]])
        await choices.start()
        await asyncio.sleep(0.05)        # choice 0's events and failure are queued
        choices.stop(0)
        seen = [(i, ev.text) async for i, ev in choices.events()]
        await choices.aclose()
        assert seen == [(1, "efgh")] and log == ["closed"]
    asyncio.run(main())
