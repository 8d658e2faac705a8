"""gpt-oss's harmony format in a chat choice's output: its reasoning, content and tool calls set
apart (as vLLM's `reasoning` field and OpenAI's `tool_calls`).

The output (after the generation prompt's `<|start|>assistant`) is a run of messages,

    [<|start|>assistant]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]<|message|>BODY<|end|>

whose last ends with <|return|> (an answer) or <|call|> (a tool call): both are EOS tokens, which
end the output and are not in its text. The recipient may also stand before the channel
(`<|start|>assistant to=functions.f<|channel|>commentary json<|message|>`). A message's BODY goes
  - on the analysis channel: to the reasoning;
  - to a recipient `functions.NAME` (a request's tool): a call of NAME whose arguments are the
    BODY (JSON text), its name out as soon as the header ends and its arguments as they arrive;
    without tools in the request, to the content;
  - anywhere else (final; commentary without a recipient, a preamble before calls): to the content.
The headers and the tags are not text of either (a tag out of place is dropped). Output that
does not open with a header (a model that writes plain text) is content, as is text after a
message's end that opens none. A model is a harmony model where its chat template writes <|channel|> and its vocabulary
has the tags (router/tools.py `template_tools`: the HARMONY syntax); a chat request to one keeps
special tokens in its text (skip_special_tokens false), or the structure would be lost, and what
it constrains (response_format's value, a forced call) is the message that answers, after the
model's free analysis (router/harmony_grammar.py).

`HarmonyStream` serves streams and whole responses alike: `feed` each piece as it arrives,
`finish` at the end; it holds back only what could still be part of a tag.
"""

from __future__ import annotations

import re
from typing import Callable

from router.chat_prompt import partial_tag
from router.tool_parser import begun

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
ENDS = (END, CALL, RETURN)               # a message's end (the last two: EOS, seen only with ignore_eos)
_TAGS = (START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN)
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")


class HarmonyStream:
    """One choice's output as (reasoning, content, call deltas); `calls`: the request has tools
    (else a message to a function is content); `new_id`: a call's id."""

    def __init__(self, calls: bool, new_id: Callable[[], str]):
        self._calls, self._new_id = calls, new_id
        self._state = "first"      # first (the output's start) | header | body | between | plain
        self._held = ""
        self._route = "content"    # the body's: reasoning | content | call
        self.count = 0             # calls begun (the next one's stream index)

    def feed(self, text: str) -> tuple[str, str, list[dict]]:
        """(reasoning, content, call deltas) now certain."""
        self._held += text
        out = ["", "", []]
        while self._step(out):
            pass
        return out[0], out[1], out[2]

    def finish(self) -> tuple[str, str, list[dict]]:
        """What was held back; the output has ended (a header cut short is dropped)."""
        out = ["", "", []]
        if self._state == "body":
            self._emit(out, self._held)
        elif self._state in ("first", "between", "plain"):
            out[1] += _untagged(self._held)
        self._held = ""
        return out[0], out[1], out[2]

    def _step(self, out: list) -> bool:
        """Consume what `_held` allows in the current state; False when it must wait for more."""
        held = self._held
        if self._state in ("first", "between"):     # a header opens here, or the rest is plain text
            stripped = held.lstrip() if self._state == "between" else held
            if stripped.startswith((START, CHANNEL)):
                self._state, self._held = "header", stripped
                return True
            if any(tag.startswith(stripped) for tag in (START, CHANNEL)):
                return False
            self._state = "plain"
        if self._state == "plain":
            keep = _partial(held)
            out[1] += _untagged(held[:len(held) - keep])
            self._held = held[len(held) - keep:]
            return False
        if self._state == "header":
            at = held.find(MESSAGE)
            if at < 0:
                return False
            self._open(held[:at], out)
            self._state, self._held = "body", held[at + len(MESSAGE):]
            return True
        # body: up to its end, or a new header opening without one
        ends = [(held.find(tag), tag) for tag in (*ENDS, START) if tag in held]
        if not ends:
            keep = _partial(held)
            self._emit(out, held[:len(held) - keep])
            self._held = held[len(held) - keep:]
            return False
        at, tag = min(ends)
        self._emit(out, held[:at])
        self._state = "header" if tag == START else "between"
        self._held = held[at:] if tag == START else held[at + len(tag):]
        return True

    def _open(self, header: str, out: list) -> None:
        """A message's header is complete: where its body goes."""
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        if recipient and recipient.group(1).startswith("functions.") and self._calls:
            self._route = "call"
            out[2].append(begun(self.count, recipient.group(1).removeprefix("functions."), self._new_id()))
            self.count += 1
        elif channel and channel.group(1) == "analysis" and not recipient:
            self._route = "reasoning"
        else:
            self._route = "content"

    def _emit(self, out: list, text: str) -> None:
        text = _untagged(text)
        if not text:
            return
        if self._route == "reasoning":
            out[0] += text
        elif self._route == "content":
            out[1] += text
        else:
            out[2].append({"index": self.count - 1, "function": {"arguments": text}})


def _partial(text: str) -> int:
    """How much of `text`'s end may be a tag still arriving."""
    return max(partial_tag(text, tag) for tag in _TAGS)


def _untagged(text: str) -> str:
    for tag in _TAGS:
        text = text.replace(tag, "")
    return text
