"""A request's validation errors (pydantic's) as one OpenAI error message and `param`.

pydantic reports a value that matches no member of a union once per member, each under a location
segment naming the member's type (`function-after[_unicode(), constrained-str]`, `list[TextPart]`,
`NamedToolChoice`): a wrong `prompt` came out as four errors under four such names. Here, per union
that failed (innermost last):
  1. the member the value came closest to matching speaks for the union: one whose type the value
     has, then one whose own constant fields (a `type` literal) matched, then the one whose errors
     lie deepest, then the fewest of them (`messages.0.content.0.type: Input should be 'text'` for
     an image part);
  2. where no member got past the value itself (a number for a prompt), their messages merge into
     one at the field: `prompt: Input should be a valid string or a valid list`;
  3. the member's name never shows in a path.
Torch- and FastAPI-free; router/app.py's handler of FastAPI's validation errors calls `describe`.
"""

from __future__ import annotations

import re
from functools import cache

from pydantic import BaseModel

MAX_SHOWN = 5
_SHOULD = "Input should be "
_VALUE_ERROR = "Value error, "
_OBJECT = re.compile(r"a valid dictionary or (instance of \w+|object to extract fields from)")
Error = tuple[tuple, str, str]      # (location, message, pydantic's error type)


def _is_member(segment, members: frozenset[str]) -> bool:
    """A location segment that names a union member rather than a field, index or key."""
    return isinstance(segment, str) and (("[" in segment and segment != "[key]") or segment in members)


def _first_member(loc: tuple, members: frozenset[str]) -> int | None:
    return next((i for i, s in enumerate(loc) if _is_member(s, members)), None)


def _merge(messages: list[str]) -> str:
    """'Input should be a valid string' + 'Input should be a valid list' -> '... string or a valid list'."""
    unique = list(dict.fromkeys(messages))
    if all(m.startswith(_SHOULD) for m in unique):
        return _SHOULD + " or ".join(m[len(_SHOULD):] for m in unique)
    return "; or ".join(unique)


def _resolve(errors: list[Error], members: frozenset[str]) -> list[Error]:
    """Replace each failed union's member errors by what speaks for it, until no member name is left."""
    while True:
        at = next(((e, i) for e in errors if (i := _first_member(e[0], members)) is not None), None)
        if at is None:
            return errors
        loc, i = at[0][0], at[1]
        prefix = loc[:i]
        group = [e for e in errors if e[0][:i] == prefix and len(e[0]) > i and _is_member(e[0][i], members)]
        by_member: dict[str, list[Error]] = {}
        for e in group:
            by_member.setdefault(e[0][i], []).append(e)
        depth = {m: max(len(e[0]) - i - 1 for e in es) for m, es in by_member.items()}
        if max(depth.values()) == 0:                                   # 2. none got past the value
            spoken = [(prefix, _merge([e[1] for e in group]), "union")]
        else:                                                          # 1. the closest member
            best = max(by_member, key=lambda m: (depth[m] > 0, not any(e[2] == "literal_error" and len(e[0]) == i + 2
                                                                       for e in by_member[m]),
                                                 depth[m], -len(by_member[m])))
            spoken = [(e[0][:i] + e[0][i + 1:], *e[1:]) for e in by_member[best]]   # 3. its name dropped
        first = errors.index(group[0])
        rest = [e for e in errors if e not in group]
        errors = rest[:first] + spoken + rest[first:]


@cache
def _router_models() -> frozenset[str]:
    """The class names of the router's request models (called once the protocol modules are imported)."""
    found, todo = set(), [BaseModel]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith("router."):
                found.add(sub.__name__)
    return frozenset(found)


def _own(msg: str, kind: str) -> str:
    """A model validator's message as it wrote it (pydantic prefixes "Value error, ")."""
    return msg.removeprefix(_VALUE_ERROR) if kind == "value_error" else msg


def describe(errors: list[dict], skip: int = 0) -> tuple[str, str | None]:
    """(message, param) for pydantic's `errors()` of a router request model; `skip` leading
    location segments are dropped (FastAPI's "body")."""
    plain = _resolve([(tuple(e.get("loc", ()))[skip:], _own(str(e.get("msg", "")), str(e.get("type", ""))),
                       str(e.get("type", ""))) for e in errors], _router_models())
    if not plain:
        return "invalid request", None
    shown = [f"{'.'.join(str(s) for s in loc) or 'body'}: {_OBJECT.sub('an object', msg)}"
             for loc, msg, _ in plain[:MAX_SHOWN]]
    return "; ".join(shown), ".".join(str(s) for s in plain[0][0]) or None
