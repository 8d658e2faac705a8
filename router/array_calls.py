"""Tool calls as a marker and a JSON array (router/tools.py's MISTRAL and GRANITE): the output's
content, then the marker and an array of calls, as vLLM's `mistral` and `granite` parsers read them:

    Let me look that up.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]

The marker is a special token where the tokenizer has it as one: the router then decodes these
requests with special tokens kept (`skip_special_tokens` false, as vLLM does), or the parser would
never see it.
  - Content streams until the marker; what may be the start of the marker is held back, and the
    whitespace before it (content before calls is trimmed at its end).
  - A call that opens as `{"name": "<name>", "arguments": {` ("parameters" too) streams as a
    Hermes block does: its name at once, its arguments as they arrive (a JSON scanner finds
    where they end). Other keys after the arguments (a model copying the history's "id") are
    skipped to the call's closing brace. "," opens the next call; "]" ends the array, and
    text after it is content again.
  - An array element that opens any other way is held to the output's end, then the rest of
    the array is read whole: if any element is not a call (an object with a string "name"),
    that rest is content (and, where no call came before it, the marker too).
Call ids are the syntax's (Mistral's: 9 letters and digits, as its templates want them back).
"""

from __future__ import annotations

import json

from router.tool_parser import HEAD, JsonCalls, ObjectEnd, call_of, head_name, held_back
from router.tools import CallSyntax

_DECODER = json.JSONDecoder()


def _rest_of_array(text: str, new_id) -> tuple[list[dict], str] | None:
    """The calls of an array's remaining elements (`text`: after its "[" or a ","), and the text
    after its "]"; None where an element is not a call or the array does not close."""
    calls, at = [], 0
    while True:
        try:
            obj, at = _DECODER.raw_decode(text, len(text) - len(text[at:].lstrip()))
        except json.JSONDecodeError:
            return None
        call = call_of(obj, new_id())
        if call is None:
            return None
        calls.append(call)
        rest = text[at:].lstrip()
        if rest[:1] == "]":
            return calls, rest[1:]
        if rest[:1] != ",":
            return None
        at = len(text) - len(rest) + 1


class ArrayCallStream(JsonCalls):
    """One choice's output in a marker-and-array syntax (`syntax`). `first_only`
    (parallel_tool_calls false): the output ends with its first call (JsonCalls)."""

    def __init__(self, syntax: CallSyntax, first_only: bool = False):
        super().__init__(first_only, syntax.new_id)
        self._marker = syntax.marker
        # content -> open ("[") -> head -> arguments -> close (the call's own brace) -> after
        # ("," -> head; "]" -> content)
        self._state = "content"
        self._after_call = False                # content right after calls starts at its first character
        self._opening = ""                      # head: the array's opening text, marker to "["

    def _take(self, final: bool) -> tuple[str, list[dict]]:
        content, calls = [], []
        while True:
            if self._ended():
                break
            state, held = self._state, self._held
            if state == "content":
                if self._after_call:
                    held = self._held = held.lstrip()
                    self._after_call = not held
                at = held.find(self._marker)
                if at < 0:
                    keep = 0 if final else held_back(held, self._marker)
                    content.append(held[:len(held) - keep])
                    self._held = held[len(held) - keep:]
                    break
                content.append(held[:at].rstrip())
                self._held, self._state = held[at + len(self._marker):], "open"
            elif state == "open":
                rest = held.lstrip()
                if not rest:
                    break
                if rest[0] == "[":
                    self._opening = self._marker + held[:len(held) - len(rest) + 1]
                    self._held, self._state = rest[1:], "head"
                else:                       # not an array: the marker's text is content
                    content.append(self._marker)
                    self._state = "content"
            elif state == "head":
                if not self._head(final, content, calls):
                    break
            elif state == "arguments":
                if not self._stream_arguments(calls):
                    break
                self._state, self._end = "close", ObjectEnd(depth=1)
            elif state == "close":           # the call's closing brace, past any other keys
                end = self._end.feed(held)
                if end < 0:
                    self._held = ""
                    break
                self._held, self._state = held[end:], "after"
            else:                            # after a call: "," or "]"
                rest = held.lstrip()
                if not rest:
                    break
                if rest[0] == ",":
                    self._held, self._state = rest[1:], "head"
                else:                        # "]" ends the array; anything else: content from here
                    self._held, self._state = rest[1:] if rest[0] == "]" else rest, "content"
                    self._after_call = True
        return "".join(content), calls

    def _head(self, final: bool, content: list[str], calls: list[dict]) -> bool:
        """An array element: a call whose name goes out now, else (at the output's end) the rest of
        the array read whole. False: wait for more text."""
        head = HEAD.match(self._held)
        name = head_name(head)
        rest = self._held.lstrip()
        if name is not None:
            self._begin(name, calls)
            self._held, self._state = self._held[head.end():], "arguments"
        elif rest[:1] == "]":                # the array ends (or was empty)
            self._held, self._state, self._after_call = rest[1:], "content", True
        elif not final and rest[:1] in ("", "{"):
            return False                     # may still be a call's head; else read whole at the end
        elif (whole := _rest_of_array(self._held, self._new_id)) is None:
            # not calls: content from here (with the marker and "[", where no call came before)
            content.append("" if self.count else self._opening)
            self._state, self._after_call = "content", bool(self.count)
        else:
            self._add_whole(whole[0], calls)
            self._held, self._state, self._after_call = whole[1], "content", True
        return True
