"""Tool calls in Llama 3's JSON syntax (router/tools.py's LLAMA3_JSON): calls are JSON objects
with a string "name", joined by ";" (vLLM's llama3_json reading), written from the output's start
(after whitespace and Llama's <|python_tag|>, where it shows).
  - A call that opens as `{"name": "<name>", "parameters": {` ("arguments" too) streams as a
    Hermes block does: its name at once, its arguments as they arrive (a JSON scanner finds where
    they end: strings and nesting followed). After its closing brace, ";" opens the next call;
    other text after it is content.
  - An output that begins with "{" any other way is held to its end, then read whole as calls:
    if any part is not one, the whole output is content. Any other output is content as it
    arrives.
"""

from __future__ import annotations

import json
import re

from router.tool_parser import HEAD_TEXT, JsonCalls, call_of, head_name
from router.tools import HERMES

_JSON_HEAD = re.compile(r'\s*(?:<\|python_tag\|>)?' + HEAD_TEXT)
PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def _json_calls(text: str) -> list[dict] | None:
    """The calls of an output that is only calls: JSON objects joined by ";", or None."""
    text, calls, at = text.strip().removeprefix(PYTHON_TAG), [], 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        try:
            obj, at = _DECODER.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        call = call_of(obj)
        if call is None:
            return None
        calls.append(call)
        rest = text[at:].lstrip()
        if not rest:
            return calls
        if rest[0] != ";":
            return None
        at = len(text) - len(rest) + 1


class JsonCallStream(JsonCalls):
    """One choice's output in Llama 3's JSON syntax. `first_only` (parallel_tool_calls false):
    the output ends with its first call (JsonCalls; the template has no turn of several)."""

    def __init__(self, first_only: bool = False):
        super().__init__(first_only, HERMES.new_id)
        # start -> content | head (a call's head; else held and read whole at the end) -> arguments ->
        # close (its own brace) -> after (";": head again; other text: content)
        self._state = "start"

    def _take(self, final: bool) -> tuple[str, list[dict]]:
        content, calls = [], []
        while True:
            if self._ended():
                break
            state, held = self._state, self._held
            if state == "start":
                head = held.lstrip()
                if head.startswith(("{", PYTHON_TAG)):
                    self._state = "head"
                elif not final and (not head or PYTHON_TAG.startswith(head)):     # may still become a call
                    break
                else:
                    self._state = "content"
            elif state == "content":
                content.append(held)
                self._held = ""
                break
            elif state == "head":               # a call's head, or an output read whole at its end
                head = _JSON_HEAD.match(held)
                name = head_name(head)
                if name is None:
                    if not final:
                        break
                    whole = _json_calls(held) if held.strip() else []
                    if whole is None:              # after calls: content from its first character
                        content.append(held.lstrip() if self.count else held)
                    self._add_whole(whole or [], calls)
                    self._held, self._state = "", "content"
                    break
                self._begin(name, calls)
                self._held, self._state = held[head.end():], "arguments"
            elif state == "arguments":
                if not self._stream_arguments(calls):
                    break
                self._state = "close"
            else:                               # close: the call's own brace; after: ";" or the end
                rest = held.lstrip()
                if not rest:
                    break
                if state == "close" and rest[0] == "}":
                    self._held, self._state = rest[1:], "after"
                elif state == "after" and rest[0] == ";":
                    self._held, self._state = rest[1:], "head"
                else:                           # text after the calls: content, from its first character
                    self._held, self._state = rest, "content"
        return "".join(content), calls
