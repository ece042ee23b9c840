"""Bounds on the JSON values a request holds: its body's fields, and the JSON text inside them (a tool call's
`arguments`), checked where they are parsed, before anything that recurses reads them.

json.loads, json.dumps, pydantic and chat templates recurse once per level of nesting: a value nested about a
thousand deep raised RecursionError (a 500) wherever it was read or written again (a stored Response, a tool
call turned into a chat turn). MAX_DEPTH is far above what a real request nests (a structured-outputs schema may
nest 64 levels, tiffin.engine.structured.limits, and sits a few levels into its body field) and far below
Python's recursion limit.

Invariant: nothing here recurses; a refusal is a ValueError whose message starts with the name it was given."""

import json
from typing import Any

MAX_DEPTH = 128  # objects and arrays in each other, counted from a body field's value or an embedded JSON text


def check_value(value: Any, name: str) -> None:
    """`value` (parsed JSON) nests at most MAX_DEPTH objects and arrays, and all of its text (keys too) is valid
    Unicode: JSON may escape a lone surrogate, which no encoder (tokenizer, JSON response) accepts."""
    stack = [(value, 1)]  # (item, how many objects and arrays hold it, itself included when it is one)
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            try:
                item.encode()
            except UnicodeEncodeError:
                raise ValueError(f"{name}: text must be valid Unicode (lone surrogate)") from None
        elif isinstance(item, (dict, list)):
            if depth > MAX_DEPTH:
                raise _too_deep(name)
            children = [*item, *item.values()] if isinstance(item, dict) else item
            stack += [(child, depth + 1) for child in children]


def loads(text: str, name: str) -> Any:
    """`text` parsed as JSON and checked by `check_value`; ValueError naming `name` when it is not valid JSON or
    nests too deep (past what json.loads can recurse, too)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise ValueError(f"{name}: not valid JSON") from None
    except RecursionError:
        raise _too_deep(name) from None
    check_value(value, name)
    return value


def _too_deep(name: str) -> ValueError:
    return ValueError(f"{name}: nests objects and arrays more than {MAX_DEPTH} deep; at most {MAX_DEPTH} are accepted")
