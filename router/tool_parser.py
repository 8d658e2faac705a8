"""What the parsers of tool calls in a chat choice's output share (the syntaxes: router/tools.py;
one parser per syntax: router/hermes_calls.py, llama3_calls.py, array_calls.py, pythonic_calls.py):
text outside calls is the message's content.

One parser per syntax serves streams and whole responses: `feed` takes each piece of text as it
arrives and gives back the content that is certain and the calls completed; `finish` flushes the
rest. A whole response is the stream fed at once (router/chat_output.py), so a streamed choice's
deltas add up to the non-streamed message.

Calls come out as OpenAI's streamed deltas, each with the call's `index`: the first with its `id`,
`type` and function `name` (and `arguments` so far), the next ones with more of its `arguments`
text; `merge_calls` adds them up into whole calls.
"""

from __future__ import annotations

import json
import re

from router.chat_prompt import partial_tag
from router.tools import HERMES, OPEN


def call_from_json(body: str) -> dict | None:
    """A call from the JSON between the tags, or None."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    return call_of(obj)


def call_of(obj, call_id: str | None = None) -> dict | None:
    """A call from a decoded JSON value, or None; `call_id`: its id (default: a new OpenAI one)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if not (isinstance(arguments, str) and is_json(arguments)):   # some models write the JSON text
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id or HERMES.new_id(), "type": "function",
            "function": {"name": obj["name"], "arguments": arguments}}


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def held_back(text: str, tag: str = OPEN) -> int:
    """How many characters at the end of content-so-far must wait: a prefix of `tag` (the calls'
    opening), and the whitespace before it."""
    keep = partial_tag(text, tag)
    while keep < len(text) and text[-keep - 1].isspace():
        keep += 1
    return keep


# the head of a call whose arguments stream: its name, then an object's opening brace (Hermes: in
# a block; Llama 3: at the output's start, maybe after <|python_tag|>, or after ";")
HEAD_TEXT = r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
HEAD = re.compile(HEAD_TEXT)


def head_name(head: re.Match | None) -> str | None:
    """The function name a head matched, None when there is no head or its string is not JSON."""
    try:
        return json.loads(head.group(1)) if head else None
    except json.JSONDecodeError:
        return None


def begun(index: int, name: str, call_id: str | None = None) -> dict:
    """A streamed call's first delta; `call_id`: its id (default: a new OpenAI one)."""
    return {"index": index, "id": call_id or HERMES.new_id(), "type": "function",
            "function": {"name": name, "arguments": ""}}


def merge_calls(deltas: list[dict]) -> list[dict]:
    """Whole calls (no `index`) from a choice's call deltas, in order."""
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.get(d["index"])
        if call is None:
            calls[d["index"]] = {"id": d["id"], "type": d["type"],
                                 "function": {"name": d["function"]["name"], "arguments": d["function"]["arguments"]}}
        else:
            call["function"]["arguments"] += d["function"]["arguments"]
    return list(calls.values())


def extend_calls(deltas: list[dict], more: list[dict]) -> None:
    """Append `more` deltas to `deltas`, a call's next arguments joined to its delta before them."""
    for d in more:
        last = deltas[-1] if deltas else None
        if last is not None and last["index"] == d["index"] and "id" not in d:
            last["function"] = {**last["function"], "arguments": last["function"]["arguments"] + d["function"]["arguments"]}
        else:
            deltas.append(d)


class ObjectEnd:
    """Where a JSON object fed in pieces ends: strings and nesting followed. With other `quotes`
    and brackets, where any such bracketed text ends (a pythonic call's arguments: ' and " strings,
    parentheses too)."""

    def __init__(self, depth: int = 0, quotes: str = '"', opens: str = "{[", closes: str = "}]"):
        """`depth`: the nesting already open (1: find the end of an object whose "{" was read)."""
        self.depth, self.quote, self.escaped = depth, "", False
        self.quotes, self.opens, self.closes = quotes, opens, closes

    def feed(self, text: str) -> int:
        """The length of `text` up to and with the closing bracket of the outermost nesting, or -1
        (not yet)."""
        for i, ch in enumerate(text):
            if self.quote:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == self.quote:
                    self.quote = ""
            elif ch in self.quotes:
                self.quote = ch
            elif ch in self.opens:
                self.depth += 1
            elif ch in self.closes:
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return -1


class CallStream:
    """What every syntax's parser shares: the text held back, the calls begun (`count`: the next
    one's stream index), `feed` and `finish`. A subclass's `_take` is its state machine."""

    def __init__(self):
        self._held = ""
        self.count = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(content now certain, call deltas): each delta with its call's stream `index`."""
        self._held += text
        return self._take(final=False)

    def finish(self) -> tuple[str, list[dict]]:
        """The same for whatever was held; the output has ended."""
        return self._take(final=True)

    @property
    def done(self) -> bool:
        """Whether no more output can change the message: its one call (parallel_tool_calls
        false) is complete. Hermes' parser never says so: its syntax ends there by a stop string."""
        return False

    def _take(self, final: bool) -> tuple[str, list[dict]]:
        raise NotImplementedError


class JsonCalls(CallStream):
    """What the streams of JSON calls (Llama 3's, Mistral's, Granite's, pythonic ones) share: calls
    begun and counted (`first_only`, parallel_tool_calls false: the output ends with the first call,
    what follows it is dropped, as Hermes' stop string ends it there), a call's arguments streamed
    as they arrive until a scanner finds their end."""

    _IN_CALL = ("arguments", "close")          # the states of a streamed call not yet complete

    def __init__(self, first_only: bool, new_id):
        super().__init__()
        self._first_only, self._new_id = first_only, new_id
        self._state = ""
        self._end: ObjectEnd | None = None      # arguments: where the call's arguments end

    @property
    def done(self) -> bool:
        return self._first_only and self.count > 0 and self._state not in self._IN_CALL

    def _ended(self) -> bool:
        """Checked before each state of `_take`: with its one call complete (`done`), whatever is
        held or comes after is dropped."""
        if self.done:
            self._held = ""
        return self.done

    def _begin(self, name: str, calls: list[dict]) -> None:
        """A call whose head (its name) was read: its first delta."""
        extend_calls(calls, [begun(self.count, name, self._new_id())])
        self.count += 1
        self._end = ObjectEnd()

    def _add_whole(self, whole: list[dict], calls: list[dict]) -> None:
        """Calls read whole (at the output's end, or a pythonic call at its ")"); with first_only
        the first only."""
        for call in whole:
            if not (self._first_only and self.count):
                extend_calls(calls, [{"index": self.count, **call}])
                self.count += 1

    def _stream_arguments(self, calls: list[dict]) -> bool:
        """Every held character of the current call's arguments goes out; True once the scanner
        found their end (the held text is what follows them)."""
        end = self._end.feed(self._held)
        out = self._held if end < 0 else self._held[:end]
        if out:
            extend_calls(calls, [{"index": self.count - 1, "function": {"arguments": out}}])
        self._held = self._held[len(out):]
        return end >= 0
