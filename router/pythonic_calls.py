"""Tool calls in the pythonic syntax (router/tools.py's PYTHONIC): the output is a Python list of
calls with keyword arguments, as vLLM's `pythonic` parser reads it (Llama 3.2 and Llama 4 with
their pythonic templates, vLLM's Gemma 3 one):

    [get_weather(city="Paris", unit="celsius"), ping()]

  - An output that opens with "[" and a name followed by "(" is calls; any other output is content
    as it arrives (what may still become "[name(" is held back).
  - Each call goes out whole once its closing parenthesis arrives: its arguments are Python
    literals (strings, numbers, True/False/None, lists, dicts; JSON's true/false/null too, and
    `**{"key": value}` for keys that are no identifiers), given as a JSON object. A call whose
    arguments are not that (positional arguments, variables, expressions), or that the output cuts
    off, ends the calls: the text from it on is content (the whole output, "[" included, where it is
    the first).
  - "," opens the next call; "]" ends the list, and text after it is content again.
Nothing is evaluated: the arguments are read by Python's parser (`ast`) and only literals taken.
"""

from __future__ import annotations

import ast
import json
import re

from router.tool_parser import JsonCalls, ObjectEnd

_HEAD = re.compile(r"\s*([A-Za-z_][\w.\-]*)\s*\(")       # a call's name and its "("
_JSON_NAMES = {"true": True, "false": False, "null": None}


class _Unreadable(Exception):
    pass


def _value(node: ast.expr):
    """A literal argument's value; _Unreadable where it is not one."""
    if isinstance(node, ast.Constant) and not isinstance(node.value, (bytes, complex, type(...))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) \
            and isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_value(e) for e in node.elts]
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(k.value, str)
                                          for k in node.keys):
        return {k.value: _value(v) for k, v in zip(node.keys, node.values)}
    raise _Unreadable


def arguments_json(text: str) -> str | None:
    """A call's arguments (the text between its parentheses) as a JSON object's text, or None."""
    try:
        call = ast.parse(f"f({text})", mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        return None
    if not isinstance(call, ast.Call) or call.args:
        return None
    out = {}
    try:
        for keyword in call.keywords:
            value = _value(keyword.value)
            if keyword.arg is None:                     # **{"key": value}
                if not isinstance(value, dict):
                    return None
                out.update(value)
            else:
                out[keyword.arg] = value
        return json.dumps(out, ensure_ascii=False)
    except (_Unreadable, ValueError):                   # (ValueError: a float too large for JSON's nan rule)
        return None


def _call_end() -> ObjectEnd:
    """Where a call's arguments, fed in pieces after its "(", end: strings ('...', "...",
    escapes) and nesting followed."""
    return ObjectEnd(depth=1, quotes="'\"", opens="([{", closes=")]}")


def _may_become_head(text: str) -> bool:
    """Whether `text` (after "[") may still become a call's head as more arrives."""
    rest = text.lstrip()
    return not rest or re.fullmatch(r"[A-Za-z_][\w.\-]*\s*", rest) is not None


class PythonicCallStream(JsonCalls):
    """One choice's output in the pythonic syntax. `first_only` (parallel_tool_calls false): the
    output ends with its first call (JsonCalls)."""

    _IN_CALL = ()                               # a call is counted when it is whole

    def __init__(self, new_id, first_only: bool = False):
        super().__init__(first_only, new_id)
        # start ("[" and a head: calls; else content) -> head (a name and "(") -> arguments (to its
        # ")") -> after ("," -> head; "]" -> content) -> content
        self._state = "start"
        self._after_call = False                # content right after calls starts at its first character
        self._opening = ""                      # the text before the first call's name: "[" and whitespace
        self._name, self._call = "", ""         # arguments: the call's name, its text so far
        self._scan = _call_end()

    def _take(self, final: bool) -> tuple[str, list[dict]]:
        content, calls = [], []
        while True:
            if self._ended():
                break
            state, held = self._state, self._held
            if state == "start":
                rest = held.lstrip()
                if rest[:1] == "[" and _HEAD.match(rest, 1):
                    self._opening = held[:len(held) - len(rest) + 1]
                    self._held, self._state = rest[1:], "head"
                elif not final and (not rest or (rest[0] == "[" and _may_become_head(rest[1:]))):
                    break
                else:
                    self._state = "content"
            elif state == "head":
                head = _HEAD.match(held)
                if head is None:
                    if not final and _may_become_head(held):
                        break
                    self._unreadable()               # not a call: the text from here is content
                    continue
                self._name, self._call, self._scan = head.group(1), held[:head.end()], _call_end()
                self._held, self._state = held[head.end():], "arguments"
            elif state == "arguments":               # to the call's ")", each piece scanned once
                end = self._scan.feed(held)
                self._call += held if end < 0 else held[:end]
                self._held = "" if end < 0 else held[end:]
                if end < 0 and not final:
                    break
                arguments = arguments_json(self._call[self._call.index("(") + 1:-1]) if end >= 0 else None
                if arguments is None:                # unreadable or cut off: content from this call on
                    self._held = self._call + self._held
                    self._unreadable()
                    continue
                self._add_whole([{"id": self._new_id(), "type": "function",
                                  "function": {"name": self._name, "arguments": arguments}}], calls)
                self._state = "after"
            elif state == "after":
                rest = held.lstrip()
                if not rest:
                    if final:
                        self._state = "content"
                    break
                if rest[0] == ",":
                    self._held, self._state = rest[1:], "head"
                else:                                 # "]" ends the list; anything else: content from here
                    self._held, self._state = rest[1:] if rest[0] == "]" else rest, "content"
                    self._after_call = True
            else:                                     # content
                if self._after_call:
                    held = held.lstrip()
                    self._after_call = not held
                content.append(held)
                self._held = ""
                break
        return "".join(content), calls

    def _unreadable(self) -> None:
        """Content from an unreadable call on: where no call came before it, the list's "[" too
        (the output as it was written); after calls, from its first character."""
        self._state = "content"
        if self.count:
            self._after_call = True
        else:
            self._held = self._opening + self._held
