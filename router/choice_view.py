"""One choice of a request as the router handles it: its sampling parameters (`choice_params`)
and what its client sees of each of its token events (`ChoiceView`), for router/app.py's
non-streamed and streamed answers."""

from __future__ import annotations

import dataclasses
import random

from engine.sampling_params import SamplingParams
from router.logprobs import LogprobsFormatter
from serving import messages


def choice_params(params: SamplingParams, j: int) -> SamplingParams:
    """The sampling parameters of the `j`-th choice of a prompt. With a seed: seed + j (a prompt's
    choices differ, each reproducible). Sampled without one: a seed drawn here, once for all the
    choice's attempts, so that a request moved on after its replica died (router/orchestrator.py)
    draws the random numbers the uninterrupted one would have, as a seeded request does (the
    engine draws from a request's own generator either way). Greedy: unchanged."""
    if params.seed is not None:
        return dataclasses.replace(params, seed=(params.seed + j) % 2**63) if j else params
    if params.greedy:
        return params
    return dataclasses.replace(params, seed=random.getrandbits(63))


class ChoiceView:
    """One choice as the client sees it: `piece(event)` gives the text and the logprobs object
    (None when not asked for) of each event; with `echo` (text, token ids), the choice's first
    piece starts with the prompt, its logprobs with the prompt's tokens. `prompt_only` (echo with
    max_tokens 0): the generated token is dropped and the choice ends with "length"."""

    def __init__(self, formatter: LogprobsFormatter | None, chat: bool, echo: tuple[str, list[int]] | None,
                 prompt_only: bool = False):
        self.formatter, self.chat, self.echo, self.prompt_only = formatter, chat, echo, prompt_only

    def finish_reason(self, ev: messages.TokenEvent) -> str | None:
        if not ev.finished:
            return None
        return "length" if self.prompt_only else ev.finish_reason

    def stop_reason(self, ev: messages.TokenEvent) -> str | int | None:
        """vLLM's `stop_reason`: the stop string or stop token id that ended the choice (None for
        EOS, a limit, or a prompt-only echo)."""
        return None if self.prompt_only or not ev.finished else ev.stop_reason

    def piece(self, ev: messages.TokenEvent) -> tuple[str, dict | None]:
        if self.prompt_only:
            ev = dataclasses.replace(ev, token_ids=(), text="", logprobs=())
        text, prompt = ev.text, None
        if self.echo is not None:
            text = self.echo[0] + text
            prompt = (self.echo[1], ev.prompt_logprobs)
            self.echo = None
        if self.formatter is None:
            return text, None
        if self.chat:
            return text, self.formatter.chat(ev.logprobs)
        return text, self.formatter.completion(ev.logprobs, prompt)


def extend_logprobs(whole: dict | None, more: dict | None) -> None:
    """Append a piece's logprobs lists to the choice's so far."""
    if whole is not None and more is not None:
        for key, value in more.items():
            if isinstance(value, list):
                whole[key].extend(value)
