"""Step 5 of a completion or chat request (router/app.py): its choices' events as one JSON body
(`Reply.collect`) or as server-sent events ending in `data: [DONE]` (`Reply.stream`).

A reply starts once every choice has its first event (a failure before that is the endpoint's
HTTP error). Then:
  1. each event becomes the choice's text and logprobs (router/choice_view.py); a chat choice
     with tools or reasoning is split into reasoning, content and tool calls
     (router/chat_output.py) as it streams, or whole;
     A chat choice with one call allowed (parallel_tool_calls false) in a syntax with no stop
     string for it is stopped once that call is complete (`Choices.stop`: aborted in the pools,
     its blocks freed), as if it had finished there ("tool_calls");
  2. a failure after the first events is an error body (collected) or an error event before
     [DONE] (streamed): a stream is never cut;
  3. at the end, `usage` (each prompt once, every choice's tokens) and the request's metrics
     (outcome, latencies) are recorded; the choices are always closed, which aborts any still
     running in the pools (a client that left mid-stream).
A chat request's vLLM `echo` puts the last message's text, an assistant's, before each choice's
content (streamed: a chunk of its own after the role chunk). With vLLM's `return_token_ids`, each
choice's output token ids come too (`token_ids`; streamed, each chunk the choice's since its last
chunk: an event that shows nothing passes its ids on), and the prompt's (`prompt_token_ids`: a chat
response's, on its stream's first chunk; a completion choice's, on its first chunk). `chunks` reads
such a stream back (the Responses and Messages APIs turn a chat stream into their own events).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from dataclasses import dataclass

from router.chat_output import ChatOutputShape, ChoiceOutput
from router.choice_view import ChoiceView, extend_logprobs
from router.choices import Choices
from router.logprobs import LogprobsFormatter, TokenStrings, vllm_prompt_logprobs
from router.metrics import RequestMetrics
from router.openai_responses import choice_body, completion_body, error_body, error_response, usage
from router.orchestrator import RequestFailed
from serving import messages


async def chunks(events):
    """The chunks of a stream `Reply.stream` made (its server-sent events: text), parsed, to
    [DONE]; the stream is closed at the end, or when the reader leaves early."""
    try:
        async for event in events:
            data = event.removeprefix("data: ").strip()
            if data == "[DONE]":
                return
            yield json.loads(data)
    finally:
        await events.aclose()


@dataclass
class Reply:
    """The answer to one request (`body`: its CompletionRequest or ChatCompletionRequest) whose
    choices have started; `firsts`: each choice's first event; `times`: (arrival, first events)
    on the monotonic clock; `echoes`: a completion's echoed prompts (text, ids), one per prompt;
    `adapter`: the LoRA adapter it runs (its output tokens are counted apart too); `prompt_ids`: the
    prompts' token ids, one per prompt, where the request asked for them (`return_token_ids`)."""
    body: object
    rid: str
    model_name: str
    chat: bool
    choices: Choices
    firsts: list[messages.TokenEvent]
    times: tuple[float, float]
    metrics: RequestMetrics
    token_strings: TokenStrings
    echoes: list[tuple[str, list[int]]] | None = None
    shape: ChatOutputShape | None = None
    adapter: str | None = None
    prompt_ids: list[list[int]] | None = None

    def _ids(self, ev: messages.TokenEvent) -> tuple[int, ...]:
        """The output token ids of an event as the client sees them (none for a prompt-only echo)."""
        return () if self.body.prompt_only else ev.token_ids

    def _views(self) -> list[ChoiceView]:
        """One view per choice (prompt p's choices are p*n .. p*n + n-1)."""
        body = self.body
        k = body.logprob_count()
        as_ids = bool(body.return_tokens_as_token_ids)
        return [ChoiceView(LogprobsFormatter(self.token_strings, k, as_ids) if k is not None else None,
                           self.chat, self.echoes[i // body.n] if self.echoes else None, body.prompt_only)
                for i in range(len(self.firsts))]

    def _prompt_logprobs(self) -> list[list[dict | None]] | None:
        """vLLM's `prompt_logprobs` of each prompt, when asked for: from its first choice's first
        event (the engine that computed the prompt sent them; the prompt's other choices show the same)."""
        k = self.body.shown_prompt_logprobs()
        if k is None:
            return None
        return [vllm_prompt_logprobs(self.token_strings, self.firsts[g].prompt_logprobs, k)
                for g in range(0, len(self.firsts), self.body.n)]

    def _usage(self, lasts: list[messages.TokenEvent]) -> dict:
        """Each prompt once, the completion tokens of every choice (none for a prompt-only echo),
        and per prompt the prompt tokens served from a prefix cache for its choice that had the
        most (choices 1..n-1 reuse choice 0's). The cache counts come with the first events: the
        engine that computed the prompt (the prefill replica's; a decode replica's events count
        none). A chat request with a `prediction`: the draft tokens taken from it that the choices
        repeated and the others, as each choice's last event counts them (a choice moved to another
        replica mid-way counts that replica's only)."""
        n, groups, firsts = self.body.n, range(0, len(lasts), self.body.n), self.firsts
        completion = 0 if self.body.prompt_only else sum(ev.num_output_tokens for ev in lasts)
        predicted = None
        if getattr(self.body, "prediction", None) is not None:         # chat's, as OpenAI counts them
            predicted = (sum(ev.accepted_prediction_tokens for ev in lasts),
                         sum(ev.rejected_prediction_tokens for ev in lasts))
        return usage(sum(lasts[g].num_prompt_tokens for g in groups), completion,
                     sum(max(ev.num_cached_tokens for ev in firsts[g:g + n]) for g in groups), predicted)

    def _observe(self, lasts: list[messages.TokenEvent]) -> None:
        tokens = [0 if self.body.prompt_only else ev.num_output_tokens for ev in lasts]
        cached = sum(ev.num_cached_tokens for ev in self.firsts) / len(self.firsts)
        self.metrics.observe(*self.times, time.monotonic(), sum(tokens), max(tokens), cached)
        if self.adapter is not None:
            self.metrics.lora_output(self.adapter, sum(tokens))

    def _ended_early(self, i: int, output: ChoiceOutput, ev: messages.TokenEvent) -> messages.TokenEvent:
        """Choice i's event `ev` once its chat `output` was fed the event's text: where that
        completed the output (ChoiceOutput.done), the choice is stopped and `ev` becomes its last."""
        if ev.finished or not output.done:
            return ev
        self.choices.stop(i)
        return dataclasses.replace(ev, finished=True, finish_reason="stop")

    async def collect(self):
        """The whole response, or the error that ended it (an OpenAI error response)."""
        views, lasts = self._views(), list(self.firsts)
        early = [self.shape.choice() for _ in lasts] if self.shape is not None and self.shape.may_end_early else None
        texts, logprobs, ids = [""] * len(lasts), [None] * len(lasts), [[] for _ in lasts]

        def take(i: int, ev: messages.TokenEvent) -> None:
            text, lp = views[i].piece(ev)
            ids[i] += self._ids(ev)
            if early:          # its one tool call complete: stopped
                early[i].feed(text)
                ev = self._ended_early(i, early[i], ev)
            texts[i] += text
            if logprobs[i] is None:
                logprobs[i] = lp
            else:
                extend_logprobs(logprobs[i], lp)
            lasts[i] = ev
        for i, ev in enumerate(self.firsts):
            take(i, ev)
        try:
            async for i, ev in self.choices.events():
                take(i, ev)
        except RequestFailed as exc:
            self.metrics.finish("error")
            return error_response(exc.code, exc.message, exc.kind)
        except asyncio.CancelledError:      # the client left (or a background response was cancelled)
            self.metrics.finish("aborted")
            raise
        finally:
            await self.choices.aclose()
        self.metrics.finish("ok")
        self._observe(lasts)
        prompt_logprobs, out = self._prompt_logprobs(), []
        for i, last in enumerate(lasts):
            text, finish, reasoning, calls = texts[i], views[i].finish_reason(last), None, None
            if self.shape is not None and not self.shape.plain:    # reasoning and tool calls apart
                output = self.shape.choice()
                reasoning, text, calls = output.message(text)
                finish = output.finish_reason(finish)
            if self.chat and (echoed := self.body.echoed()):
                text = echoed + (text or "")
            choice = choice_body(i, text, finish, self.chat, chunk=False, logprobs=logprobs[i], tool_calls=calls,
                                 reasoning=reasoning)
            if prompt_logprobs is not None and not self.chat:
                choice["prompt_logprobs"] = prompt_logprobs[i // self.body.n]
            choice["stop_reason"] = views[i].stop_reason(last)
            if self.prompt_ids is not None:
                choice["token_ids"] = ids[i]
                if not self.chat:
                    choice["prompt_token_ids"] = self.prompt_ids[i // self.body.n]
            out.append(choice)
        whole = completion_body(self.rid, self.model_name, out, self.chat, chunk=False, use=self._usage(lasts))
        if prompt_logprobs is not None and self.chat:
            whole["prompt_logprobs"] = prompt_logprobs[0]
        if self.prompt_ids is not None and self.chat:
            whole["prompt_token_ids"] = self.prompt_ids[0]
        return whole

    async def stream(self):
        """The server-sent events: a chat's role chunks, a chunk per event that shows something
        (each with the usage so far, where continuous usage was asked for), the usage chunk if
        asked for, an error event if the request failed, then [DONE]."""
        chat, firsts, want_ids = self.chat, self.firsts, self.prompt_ids is not None
        pending: list[list[int]] = [[] for _ in firsts]   # output ids not yet in a chunk, per choice
        opened = [False] * len(firsts)                    # a completion choice's first chunk went out

        def data(choice: dict | None = None, use: dict | None = None, prompt_ids: list[int] | None = None) -> str:
            if choice and self.body.continuous_usage:
                use = self._usage(lasts)
            obj = completion_body(self.rid, self.model_name, [choice] if choice else [], chat, chunk=True, use=use)
            if prompt_ids is not None:                    # a chat stream's first chunk
                obj["prompt_token_ids"] = prompt_ids
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        def with_ids(i: int, choice: dict) -> dict:
            """A choice's chunk with its output ids since its last (and, a completion's first, the prompt's)."""
            if want_ids:
                choice["token_ids"], pending[i] = pending[i], []
                if not chat and not opened[i]:
                    choice["prompt_token_ids"], opened[i] = self.prompt_ids[i // self.body.n], True
            return choice

        views, lasts, outcome = self._views(), list(firsts), "aborted"
        shape = self.shape
        outputs = [shape.choice() for _ in firsts] if shape is not None and not shape.plain else None

        def chunk(i: int, ev: messages.TokenEvent) -> str | None:
            text, lp = views[i].piece(ev)
            pending[i] += self._ids(ev)
            piece = None
            if outputs:      # the reasoning, content and calls certain so far (router/chat_output.py)
                piece = outputs[i].feed(text)
                ev = self._ended_early(i, outputs[i], ev)
            lasts[i], finish = ev, views[i].finish_reason(ev)
            if outputs:
                if ev.finished:
                    piece += outputs[i].finish()
                    finish = outputs[i].finish_reason(finish)
                text = piece.content
            if not (text or piece and (piece.calls or piece.reasoning) or ev.finished or (lp and any(lp.values()))):
                return None
            body = choice_body(i, text, finish, chat, chunk=True, logprobs=lp, tool_calls=piece and piece.calls,
                               reasoning=piece and piece.reasoning)
            if finish is not None:
                body["stop_reason"] = views[i].stop_reason(ev)
            return data(with_ids(i, body))
        try:
            if chat:
                for i in range(len(firsts)):
                    yield data(choice_body(i, "", None, True, chunk=True, first=True),
                               prompt_ids=self.prompt_ids[0] if want_ids and i == 0 else None)
                    if echoed := self.body.echoed():
                        yield data(choice_body(i, echoed, None, True, chunk=True))
            for i, ev in enumerate(firsts):
                if (text := chunk(i, ev)) is not None:
                    yield text
            async for i, ev in self.choices.events():
                if (text := chunk(i, ev)) is not None:
                    yield text
            if not all(ev.finished for ev in lasts):
                raise RequestFailed(500, "the stream ended without finishing")
            self._observe(lasts)
            if self.body.include_usage:
                yield data(use=self._usage(lasts))
            outcome = "ok"
        except RequestFailed as exc:
            outcome = "error"
            yield f"data: {json.dumps(error_body(exc.message, exc.kind, code=exc.code), ensure_ascii=False)}\n\n"
        finally:
            self.metrics.finish(outcome)
            await self.choices.aclose()
        yield "data: [DONE]\n\n"
