"""The Lark grammar of a forced call in the pythonic syntax (router/tools.py's PYTHONIC): a Python
list of calls with keyword arguments, each argument's value a JSON value of its property's schema
(JSON's true, false and null included: router/pythonic_calls.py reads them as Python's):

    [get_weather(city="Paris", unit="celsius"), ping()]

A function's properties come in the order its schema lists them, each required one always and
each other one optional; a property whose name is no Python identifier is written as `**{"name":
value}`. Properties the schema does not list are never written (a value without them is still one
of the schema's). The JSON values are compact, as structured output's.
"""

from __future__ import annotations

import json

from engine.structured_output import JSON_OPTIONS, without_annotations

_REFERENCED = ("$defs", "definitions")       # where "#/..." references of a property's schema point


def pythonic_lines(index: int, name: str, parameters: dict) -> list[str]:
    """Rule `f<index>` (one call of function `name`) and the rules it uses, for a function whose
    parameters' schema is `parameters`."""
    schema = without_annotations(parameters)
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    shared = {k: schema[k] for k in _REFERENCED if k in schema}
    items, lines = [], []
    for j, (prop, sub) in enumerate(properties.items()):
        rule = f"p{index}_{j}"
        key = f"{prop}=" if prop.isidentifier() else f"**{{{json.dumps(prop)}: "
        end = "" if prop.isidentifier() else "}"
        value = {**sub, **shared, "x-guidance": JSON_OPTIONS} if isinstance(sub, dict) else sub
        lines += [" ".join([f"{rule}:", json.dumps(key), f"v{index}_{j}", *[json.dumps(end)] * bool(end)]),
                  f"v{index}_{j}: %json {json.dumps(value)}"]
        items.append((rule, prop in required))
    lines.insert(0, f"f{index}: {json.dumps(name + '(')} {_sequence(index, items, lines)} \")\"")
    return lines


def _sequence(index: int, items: list[tuple[str, bool]], lines: list[str]) -> str:
    """The Lark term of the keyword list: `items` (rule, required) in order, each optional one
    present or not, ", " between two. Rule `h<index>_<j>`: the list from item j on, none written
    before it; `t<index>_<j>`: the same after one was; either at j = len(items) is empty."""
    n = len(items)
    lines += [f'h{index}_{n}: ""', f't{index}_{n}: ""']
    for j in range(n - 1, -1, -1):
        rule, needed = items[j]
        h, t, h_next, t_next = (f"{k}{index}_{m}" for k, m in (("h", j), ("t", j), ("h", j + 1), ("t", j + 1)))
        lines.append(f"{h}: {rule} {t_next}" + ("" if needed else f" | {h_next}"))
        lines.append(f'{t}: ", " {rule} {t_next}' + ("" if needed else f" | {t_next}"))
    return f"h{index}_0"
