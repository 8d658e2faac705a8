"""Tool calls in a chat choice's output (the syntaxes: router/tools.py): text outside calls is the
message's content.

One parser per syntax serves streams and whole responses: `feed` takes each piece of text as it
arrives and gives back the content that is certain and the calls completed; `finish` flushes the
rest. A whole response is the stream fed at once (router/chat_output.py), so a streamed choice's
deltas add up to the non-streamed message.

Calls come out as OpenAI's streamed deltas, each with the call's `index`: the first with its `id`,
`type` and function `name` (and `arguments` so far), the next ones with more of its `arguments`
text; `merge_calls` adds them up into whole calls.

`ToolCallStream` (Hermes): each <tool_call> block whose JSON names a function is a call. The rules:
  - A block that opens as `{"name": "<name>", "arguments": {` ("parameters" too) is a call from
    there: its name goes out at once and its arguments' JSON text as it arrives, as the model
    wrote it, held back only where it may be the object's closing brace or the </tool_call> tag
    (so a long argument, a file's text, streams). It ends at </tool_call> or the output's end (a
    block cut by max_tokens is a call whose arguments are cut).
  - Any other block is held until its </tool_call> (or the output's end) and is a call if its
    JSON is an object with a string "name"; its "arguments" (or "parameters") become the call's
    arguments as JSON text. A block whose JSON is not that stays in the content, tags and all (as
    vLLM's Hermes parser does).
  - Content is held back while it could still be the start of <tool_call>, or is trailing
    whitespace: content right before a call is trimmed at its end, and content right after a
    call at its start (the newlines around blocks are not content).
  - Output without calls comes out unchanged, whitespace included.

`JsonCallStream` (Llama 3's JSON): calls are JSON objects with a string "name", joined by ";"
(vLLM's llama3_json reading), written from the output's start (after whitespace and Llama's
<|python_tag|>, where it shows).
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

from router.chat_prompt import partial_tag
from router.tools import CLOSE, HERMES, OPEN


def _call(body: str) -> dict | None:
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
    if not (isinstance(arguments, str) and _is_json(arguments)):   # some models write the JSON text
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id or HERMES.new_id(), "type": "function",
            "function": {"name": obj["name"], "arguments": arguments}}


def _is_json(text: str) -> bool:
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
_HEAD_TEXT = r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
HEAD = re.compile(_HEAD_TEXT)
_JSON_HEAD = re.compile(r'\s*(?:<\|python_tag\|>)?' + _HEAD_TEXT)


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


def _arguments_end(text: str) -> str:
    """A streamed block's arguments, from its text up to </tool_call> (or the output's end): the
    object's closing brace dropped where what is before it is JSON."""
    text = text.rstrip()
    return text[:-1].rstrip() if text.endswith("}") and _is_json(text[:-1]) else text


def _streamable(text: str) -> int:
    """How much of a streamed block's arguments text so far can go: all but an end that may be
    the object's closing brace and </tool_call> (and the whitespace around them)."""
    end = len(text) - partial_tag(text, CLOSE)
    end = len(text[:end].rstrip())
    if end and text[end - 1] == "}":
        end = len(text[:end - 1].rstrip())
    return end


class ToolCallStream:
    """One choice's output, split into content and call deltas as it arrives."""

    def __init__(self):
        self._held = ""          # outside a block: content not yet certain; in one: its text after <tool_call>
        self._gap = ""           # in a block: the whitespace between the content and <tool_call>
        self._mode = "content"   # content -> block (held whole) | arguments (streaming) -> content
        self._sent: list[str] = []   # arguments: the block's arguments text already out
        self._after_call = False
        self.count = 0           # calls begun so far; the next one's stream index

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(content now certain, call deltas): each delta with its call's stream `index`."""
        self._held += text
        return self._take(final=False)

    def finish(self) -> tuple[str, list[dict]]:
        """The same for whatever was held; the output has ended."""
        return self._take(final=True)

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
        call = _call(self._held[:stop - (len(CLOSE) if end >= 0 else 0)])
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


class ObjectEnd:
    """Where a JSON object fed in pieces ends: strings and nesting followed."""

    def __init__(self, depth: int = 0):
        """`depth`: the nesting already open (1: find the end of an object whose "{" was read)."""
        self.depth, self.in_string, self.escaped = depth, False, False

    def feed(self, text: str) -> int:
        """The length of `text` up to and with the object's closing brace, or -1 (not yet)."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return -1


class JsonCalls:
    """What the streams of JSON calls (Llama 3's, Mistral's) share: the text held, calls begun and
    counted (`first_only`, parallel_tool_calls false: calls after the first are dropped), a call's
    arguments streamed as they arrive until a scanner finds their end. A subclass's `_take` is its
    state machine."""

    def __init__(self, first_only: bool, new_id):
        self._held = ""
        self._first_only, self._new_id = first_only, new_id
        self._end: ObjectEnd | None = None      # arguments: where the call's arguments end
        self._dropped = False                   # arguments: the call is one first_only drops
        self.count = 0                          # calls begun so far; the next one's stream index

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(content now certain, call deltas): each delta with its call's stream `index`."""
        self._held += text
        return self._take(final=False)

    def finish(self) -> tuple[str, list[dict]]:
        """The same for whatever was held; the output has ended."""
        return self._take(final=True)

    def _take(self, final: bool) -> tuple[str, list[dict]]:
        raise NotImplementedError

    def _begin(self, name: str, calls: list[dict]) -> None:
        """A call whose head (its name) was read: its first delta, unless first_only drops it."""
        self._dropped = self._first_only and self.count > 0
        if not self._dropped:
            extend_calls(calls, [begun(self.count, name, self._new_id())])
            self.count += 1
        self._end = ObjectEnd()

    def _add_whole(self, whole: list[dict], calls: list[dict]) -> None:
        """Calls read whole (at the output's end), but those first_only drops."""
        for call in whole:
            if not (self._first_only and self.count):
                extend_calls(calls, [{"index": self.count, **call}])
                self.count += 1

    def _stream_arguments(self, calls: list[dict]) -> bool:
        """Every held character of the current call's arguments goes out (unless the call is
        dropped); True once the scanner found their end (the held text is what follows them)."""
        end = self._end.feed(self._held)
        out = self._held if end < 0 else self._held[:end]
        if out and not self._dropped:
            extend_calls(calls, [{"index": self.count - 1, "function": {"arguments": out}}])
        self._held = self._held[len(out):]
        return end >= 0


class JsonCallStream(JsonCalls):
    """One choice's output in Llama 3's JSON syntax. `first_only` (parallel_tool_calls false):
    calls after the first are dropped (the template has no turn of several)."""

    def __init__(self, first_only: bool = False):
        super().__init__(first_only, HERMES.new_id)
        # start -> content | head (a call's head; else held and read whole at the end) -> arguments ->
        # close (its own brace) -> after (";": head again; other text: content)
        self._state = "start"

    def _take(self, final: bool) -> tuple[str, list[dict]]:
        content, calls = [], []
        while True:
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

