"""Tool calls in the Hermes syntax (router/tools.py's HERMES): each <tool_call> block whose JSON
names a function is a call. The rules:
  - A block that opens as `{"name": "<name>", "arguments": {` ("parameters" too) is a call from
    there: its name goes out at once and its arguments' JSON text as it arrives, as the model
    wrote it, held back only where it may be the object's closing brace or the </tool_call> tag
    (so a long argument, a file's text, streams). It ends at </tool_call> or the output's end (a
    block cut by max_tokens is a call whose arguments are cut).
  - Any other block is held until its </tool_call> (or the output's end) and is a call if its
    JSON is an object with a string "name"; its "arguments" (or "parameters") become the call's
    arguments as JSON text. A block whose JSON is not that stays in the content, tags and all (as
    vLLM's Hermes parser does). With GLM-4.5's syntax (GLM45) a held block may also be its name and
    key / value pairs (`call_from_pairs`).
  - Content is held back while it could still be the start of <tool_call>, or is trailing
    whitespace: content right before a call is trimmed at its end, and content right after a
    call at its start (the newlines around blocks are not content).
  - Output without calls comes out unchanged, whitespace included.
"""

from __future__ import annotations

import json
import re

from router.chat_prompt import partial_tag
from router.tool_parser import (HEAD, CallStream, begun, call_from_json, extend_calls, head_name, held_back,
                                is_json)
from router.tools import CLOSE, HERMES, OPEN

_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def call_from_pairs(body: str, string_args: dict[str, tuple[str, ...]]) -> dict | None:
    """GLM-4.5's call from a block's text: the function's name, then <arg_key>K</arg_key>
    <arg_value>V</arg_value> pairs (whitespace around them); V is the text itself for a parameter
    `string_args` names for the function (its schema's type is string), else JSON (the text where
    it is not JSON). None where the block is not that."""
    cut = body.find("<arg_key>")
    name, rest = (body, "") if cut < 0 else (body[:cut], body[cut:])
    name, at = name.strip(), 0
    if not _NAME.fullmatch(name):
        return None
    arguments = {}
    for pair in _PAIR.finditer(rest):
        if pair.start() != at:
            return None
        key, value, at = pair.group(1).strip(), pair.group(2), pair.end()
        if key not in string_args.get(name, ()):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                pass
        arguments[key] = value
    if rest[at:].strip():
        return None
    return {"id": HERMES.new_id(), "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _arguments_end(text: str) -> str:
    """A streamed block's arguments, from its text up to </tool_call> (or the output's end): the
    object's closing brace dropped where what is before it is JSON."""
    text = text.rstrip()
    return text[:-1].rstrip() if text.endswith("}") and is_json(text[:-1]) else text


def _streamable(text: str) -> int:
    """How much of a streamed block's arguments text so far can go: all but an end that may be
    the object's closing brace and </tool_call> (and the whitespace around them)."""
    end = len(text) - partial_tag(text, CLOSE)
    end = len(text[:end].rstrip())
    if end and text[end - 1] == "}":
        end = len(text[:end - 1].rstrip())
    return end


class ToolCallStream(CallStream):
    """One choice's output, split into content and call deltas as it arrives. `_held`: outside a
    block, content not yet certain; in one, its text after <tool_call>."""

    def __init__(self, string_args: dict[str, tuple[str, ...]] | None = None):
        """`string_args`: GLM-4.5's syntax, each function's string parameters (router/tools.py
        `string_parameters`); None: Hermes' JSON blocks only."""
        super().__init__()
        self._string_args = string_args
        self._gap = ""           # in a block: the whitespace between the content and <tool_call>
        self._mode = "content"   # content -> block (held whole) | arguments (streaming) -> content
        self._sent: list[str] = []   # arguments: the block's arguments text already out
        self._after_call = False

    def _take(self, final: bool) -> tuple[str, list[dict]]:
        content, calls = [], []
        while True:
            if self._mode == "arguments":
                if not self._arguments(final, calls):
                    return "".join(content), calls
            elif self._mode == "block":
                if not self._block(final, content, calls):
                    return "".join(content), calls
            else:
                start = self._held.find(OPEN)
                if start < 0:
                    keep = 0 if final else held_back(self._held)
                    content.append(self._content(self._held[:len(self._held) - keep]))
                    self._held = self._held[len(self._held) - keep:]
                    return "".join(content), calls
                cut = len(self._held[:start].rstrip())
                content.append(self._content(self._held[:cut]))
                self._gap, self._held, self._mode = self._held[cut:start], self._held[start + len(OPEN):], "block"

    def _block(self, final: bool, content: list[str], calls: list[dict]) -> bool:
        """A block not known to stream yet. False: wait for more text."""
        end = self._held.find(CLOSE)
        head = HEAD.match(self._held)
        name = head_name(head) if head and (end < 0 or head.end() <= end) else None
        if name is not None:              # a call from here: its name now, its arguments as they come
            extend_calls(calls, [begun(self.count, name)])
            self.count += 1
            self._held, self._mode, self._sent, self._after_call = self._held[head.end():], "arguments", [], True
            return True
        if end < 0 and not final:
            return False
        stop = len(self._held) if end < 0 else end + len(CLOSE)
        body = self._held[:stop - (len(CLOSE) if end >= 0 else 0)]
        call = call_from_json(body)
        if call is None and self._string_args is not None:
            call = call_from_pairs(body, self._string_args)
        if call is None:
            content.append(self._content(self._gap + OPEN + self._held[:stop]))
        else:
            extend_calls(calls, [{"index": self.count, **call}])
            self.count += 1
            self._after_call = True
        self._held, self._mode = self._held[stop:], "content"
        return True

    def _arguments(self, final: bool, calls: list[dict]) -> bool:
        """A streaming block's arguments (`_held`: the text not sent yet). False: wait for more."""
        end = self._held.find(CLOSE)
        if end < 0 and not final:
            out = self._held[:_streamable(self._held)]
            self._held = self._held[len(out):]
        else:
            text = self._held[:end] if end >= 0 else self._held[:len(self._held) - partial_tag(self._held, CLOSE)]
            sent = "".join(self._sent)
            out = _arguments_end(sent + text)[len(sent):]
            self._held = self._held[end + len(CLOSE):] if end >= 0 else ""
            self._mode = "content"
        if out:
            extend_calls(calls, [{"index": self.count - 1, "function": {"arguments": out}}])
            self._sent.append(out)
        return self._mode == "content"

    def _content(self, text: str) -> str:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        return text
