"""vLLM's fields in the answers (router/reply.py) over scripted runs (no Ray). `return_token_ids`:
each choice's output token ids (`token_ids`) and the prompt's (`prompt_token_ids`: the chat
response's, each completion choice's), whole and streamed; streamed, the ids of an event that shows
nothing (its text held back) come with the choice's next chunk, a chat stream's prompt ids on its
first chunk and a completion choice's on its first, and the chunks' ids add up to the whole
response's; a prompt-only echo has none; a request that does not ask has none of these fields.
`stop_reason`: the stop string or token id that ended a choice, on its last chunk. `request_id` (and
the X-Request-Id header): the answer's id. Chat's `echo`: the prefilled assistant message before the
content."""

import asyncio
import json

import pytest
from pydantic import ValidationError

from router.chat_protocol import ChatCompletionRequest
from router.choices import Choices
from router.logprobs import TokenStrings
from router.metrics import RequestMetrics
from router.openai_protocol import CompletionRequest
from router.protocol_types import MAX_REQUEST_ID, reply_id
from router.reply import Reply
from serving.messages import TokenEvent

PROMPTS = [[11, 12, 13], [21, 22]]


class Run:
    """A choice's run: events of (token ids, text), the last one finished (by `stop_reason`)."""

    def __init__(self, events: list[tuple[tuple[int, ...], str]], stop_reason: str | int | None = None):
        self.events, self.stop_reason = events, stop_reason

    async def __call__(self, ready):
        for k, (ids, text) in enumerate(self.events):
            done = k == len(self.events) - 1
            yield TokenEvent("r", ids, text, done, "stop" if done else None, num_prompt_tokens=3,
                             num_output_tokens=sum(len(i) for i, _ in self.events[:k + 1]),
                             stop_reason=self.stop_reason if done else None)
            ready()
            await asyncio.sleep(0.001)


def run_reply(body, chat: bool, runs: list[list[Run]], prompts, rid: str = "rid"):
    async def main():
        choices = Choices(runs)
        firsts = await choices.start()
        r = Reply(body, rid, "m", chat, choices, firsts, (0.0, 0.0), RequestMetrics(), TokenStrings(None),
                  prompt_ids=prompts if body.return_token_ids else None)
        if not body.stream:
            return await asyncio.wait_for(r.collect(), 10)
        chunks = [c async for c in r.stream()]
        assert chunks[-1] == "data: [DONE]\n\n"
        return [json.loads(c.removeprefix("data: ")) for c in chunks[:-1]]
    return asyncio.run(main())


# a choice's events: the second shows nothing (its text held back, as a stop string's start would be)
EVENTS = [[((5,), "Hel"), ((6,), ""), ((7, 8), "lo!")], [((9,), "Hi"), ((10,), " there")]]


def test_a_chat_response_carries_its_prompt_ids_and_each_choice_its_output_ids_whole_and_streamed():
    body = dict(model="m", messages=[{"role": "user", "content": "hi"}], n=2, return_token_ids=True)
    whole = run_reply(ChatCompletionRequest(**body), True, [[Run(e) for e in EVENTS]], PROMPTS[:1])
    assert whole["prompt_token_ids"] == PROMPTS[0]
    assert [c["token_ids"] for c in whole["choices"]] == [[5, 6, 7, 8], [9, 10]]
    assert [c["message"]["content"] for c in whole["choices"]] == ["Hello!", "Hi there"]
    chunks = run_reply(ChatCompletionRequest(**body, stream=True), True, [[Run(e) for e in EVENTS]], PROMPTS[:1])
    assert chunks[0]["prompt_token_ids"] == PROMPTS[0] and all("prompt_token_ids" not in c for c in chunks[1:])
    for i, expected in enumerate(([5, 6, 7, 8], [9, 10])):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert sum((c.get("token_ids", []) for c in mine), []) == expected
        assert all(c["delta"]["content"] or c["finish_reason"] or "role" in c["delta"] for c in mine)
    # the held-back event's id came with the next chunk of its choice
    assert [c["choices"][0]["token_ids"] for c in chunks if c["choices"] and c["choices"][0]["index"] == 0
            and "token_ids" in c["choices"][0]] == [[5], [6, 7, 8]]
    plain = run_reply(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}]), True,
                      [[Run(EVENTS[0])]], PROMPTS[:1])
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def test_completion_choices_carry_their_prompts_ids_and_their_output_ids_whole_and_streamed():
    body = dict(model="m", prompt=PROMPTS, n=1, return_token_ids=True, max_tokens=4)
    runs = [[Run(EVENTS[0])], [Run(EVENTS[1])]]
    whole = run_reply(CompletionRequest(**body), False, runs, PROMPTS)
    assert [(c["prompt_token_ids"], c["token_ids"]) for c in whole["choices"]] == [
        (PROMPTS[0], [5, 6, 7, 8]), (PROMPTS[1], [9, 10])]
    chunks = run_reply(CompletionRequest(**body, stream=True), False, [[Run(EVENTS[0])], [Run(EVENTS[1])]], PROMPTS)
    for i, (prompt, expected) in enumerate(zip(PROMPTS, ([5, 6, 7, 8], [9, 10]))):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert mine[0]["prompt_token_ids"] == prompt and all("prompt_token_ids" not in c for c in mine[1:])
        assert sum((c["token_ids"] for c in mine), []) == expected
    # echo with max_tokens 0: the prompt only, no output ids
    echo = run_reply(CompletionRequest(model="m", prompt=PROMPTS[0], echo=True, max_tokens=0, return_token_ids=True),
                     False, [[Run([((5,), "x")])]], PROMPTS[:1])
    assert echo["choices"][0]["token_ids"] == [] and echo["choices"][0]["prompt_token_ids"] == PROMPTS[0]


def test_stop_reason_is_the_stop_string_or_token_that_ended_a_choice_on_its_last_chunk():
    for stream in (False, True):
        for chat in (False, True):
            body = (ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], n=2, stream=stream)
                    if chat else CompletionRequest(model="m", prompt=PROMPTS[0], n=2, stream=stream))
            got = run_reply(body, chat, [[Run(EVENTS[0], "lo"), Run(EVENTS[1], 7)]], PROMPTS[:1])
            if not stream:
                assert [c["stop_reason"] for c in got["choices"]] == ["lo", 7]
                continue
            ends = {c["choices"][0]["index"]: c["choices"][0]["stop_reason"] for c in got
                    if c["choices"] and c["choices"][0]["finish_reason"]}
            assert ends == {0: "lo", 1: 7}
            assert all("stop_reason" not in c["choices"][0] for c in got if c["choices"]
                       and not c["choices"][0]["finish_reason"])
    echo = run_reply(CompletionRequest(model="m", prompt=PROMPTS[0], echo=True, max_tokens=0), False,
                     [[Run([((5,), "x")], 5)]], PROMPTS[:1])
    assert echo["choices"][0]["stop_reason"] is None and echo["choices"][0]["finish_reason"] == "length"


def test_the_answer_id_is_the_clients_request_id_or_x_request_id_header_as_vllm_names_them():
    headers = {"x-request-id": "trace-7"}
    assert reply_id("cmpl", {}, None) is None                       # the caller's random one then
    assert reply_id("cmpl", {}, "mine") == "cmpl-mine"
    assert reply_id("chatcmpl", headers, "mine") == "chatcmpl-mine"       # the body's first (Serve sets the header)
    assert reply_id("chatcmpl", headers, None) == "chatcmpl-trace-7"
    assert reply_id("cmpl", {"x-request-id": "x" * (MAX_REQUEST_ID + 1)}, None) is None
    assert reply_id("cmpl", {"x-request-id": ""}, None) is None
    body = CompletionRequest(model="m", prompt="hi", request_id="abc", stream=True)
    chunks = run_reply(body, False, [[Run(EVENTS[0])]], PROMPTS[:1], rid="cmpl-abc")
    assert {c["id"] for c in chunks} == {"cmpl-abc"}
    for wrong in ("", "x" * (MAX_REQUEST_ID + 1), 7):
        with pytest.raises(ValidationError):
            CompletionRequest(model="m", prompt="hi", request_id=wrong)


def test_chat_echo_puts_the_prefilled_assistant_message_before_each_choices_content():
    prefilled = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "A ripe "}]
    body = dict(model="m", messages=prefilled, n=2, echo=True, add_generation_prompt=False,
                continue_final_message=True)
    whole = run_reply(ChatCompletionRequest(**body), True, [[Run(e) for e in EVENTS]], PROMPTS[:1])
    assert [c["message"]["content"] for c in whole["choices"]] == ["A ripe Hello!", "A ripe Hi there"]
    chunks = run_reply(ChatCompletionRequest(**body, stream=True), True, [[Run(e) for e in EVENTS]], PROMPTS[:1])
    for i, text in enumerate(("Hello!", "Hi there")):
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"][0]["index"] == i]
        assert deltas[0] == {"role": "assistant", "content": ""} and deltas[1] == {"content": "A ripe "}
        assert "".join(d.get("content") or "" for d in deltas) == "A ripe " + text
    # no echo, or a last message that is not an assistant's: the content alone
    for fields in ({**body, "echo": False}, {**body, "messages": prefilled[:1], "continue_final_message": False}):
        out = run_reply(ChatCompletionRequest(**fields), True, [[Run(e) for e in EVENTS]], PROMPTS[:1])
        assert [c["message"]["content"] for c in out["choices"]] == ["Hello!", "Hi there"]
