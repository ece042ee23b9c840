"""Bounds on a structured-outputs spec, checked before anything that recurses or compiles reads it.

jsonschema's schema check and Python's `re` recurse once per level of nesting (a deep spec raised
RecursionError), and xgrammar's time grows superlinearly with the nesting of a grammar (about n³ for a chain
of n `$ref`s or rules: 2,000 rules took seconds to minutes) and about linearly with its width. Within these
limits the worst shapes measured check and build in under a second (a 4,096-branch anyOf: 0.6 s to check; a
chain of 1,024 rules: 0.3 s to compile on a 32k vocabulary); what they do not foresee, the compile deadline
(grammar_compile_timeout) bounds.

Invariant: every function here walks its input without recursing (json.loads's own recursion is caught), in
time linear in its size, and refuses with a ValueError that names the limit exceeded (`at most N ...`)."""

import json
import re
from typing import Any

MAX_SPEC_BYTES = 128 * 1024  # a schema, grammar, regex, choice list or structural tag, as text
MAX_NESTING = 64  # objects and arrays in each other; schemas in each other, through `$ref` too; groups in a regex
MAX_NODES = 4096  # objects and arrays in one spec: the branches and properties every check walks
MAX_REPEAT = 100_000  # a regex count {m,n}; Python's re overflows past 2**32, xgrammar past 10**10
MAX_RULES = 1024  # rules of an EBNF grammar

_COUNT = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def check_text(text: str, name: str) -> None:
    """`text` (a spec given as text) is at most MAX_SPEC_BYTES long in UTF-8."""
    size = len(text.encode(errors="surrogatepass"))
    if size > MAX_SPEC_BYTES:
        raise ValueError(f"{name} takes {size} bytes; at most {MAX_SPEC_BYTES} bytes are accepted")


def load_json(text: str, name: str) -> Any:
    """`text` parsed, once it is known to be short enough; ValueError for invalid or too deeply nested JSON."""
    check_text(text, name)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name} is not valid JSON: {e}") from None
    except RecursionError:  # json.loads recurses per level: a few thousand levels exhaust the stack
        raise ValueError(
            f"{name} nests too deep; at most {MAX_NESTING} levels of objects and arrays are accepted"
        ) from None


_END = object()


def check_shape(value: Any, name: str) -> None:
    """`value` (a spec given as JSON values) nests at most MAX_NESTING objects and arrays, holds at most MAX_NODES
    of them, and is at most MAX_SPEC_BYTES as JSON text. Only after this may recursive code walk it."""
    # a stack of iterators, one per open object or array, each at the depth of its items: a wide list is walked
    # only as far as the limits allow (all its items pushed at once, 200,000 of them took a second under load)
    nodes, stack = 0, [(iter((value,)), 1)]
    while stack:
        items, depth = stack[-1]
        item = next(items, _END)
        if item is _END:
            stack.pop()
            continue
        if isinstance(item, dict):
            children = iter(item.values())
        elif isinstance(item, (list, tuple)):
            children = iter(item)
        else:
            continue
        nodes += 1
        if depth > MAX_NESTING:
            raise ValueError(
                f"{name} nests objects and arrays more than {MAX_NESTING} deep; at most {MAX_NESTING} are accepted"
            )
        if nodes > MAX_NODES:
            raise ValueError(f"{name} has more than {MAX_NODES} objects and arrays; at most {MAX_NODES} are accepted")
        stack.append((children, depth + 1))
    check_text(json.dumps(value), name)


def check_schema_patterns(schema: Any) -> None:
    """Every regex of `schema` (each `pattern`, each `patternProperties` name) is within `regex_problem`'s limits,
    wherever it sits: jsonschema compiles them with Python's re while checking the schema, before anything else
    looks at them. `schema` has passed `check_shape`."""
    stack = [(schema, "#")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict):
            regexes = [("pattern", node["pattern"])] if isinstance(node.get("pattern"), str) else []
            if isinstance(node.get("patternProperties"), dict):
                regexes += [("patternProperties", name) for name in node["patternProperties"]]
            for keyword, regex in regexes:
                problem = regex_problem(regex)
                if problem:
                    raise ValueError(f"JSON schema keyword '{keyword}' at {path} cannot be enforced: {problem}")
            stack.extend((child, f"{path}/{key}") for key, child in node.items())
        elif isinstance(node, list):
            stack.extend((child, f"{path}/{i}") for i, child in enumerate(node))


def regex_problem(regex: str) -> str | None:
    """Why `regex` exceeds the limits (groups nested deeper than MAX_NESTING, a count above MAX_REPEAT), or None.
    A linear scan that skips escapes and character classes, where parentheses and braces are literal."""
    depth = deepest = i = 0
    while i < len(regex):
        c = regex[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            i += 2 if regex.startswith("[^]", i) or regex.startswith("[]", i) else 1
            while i < len(regex) and regex[i] != "]":
                i += 2 if regex[i] == "\\" else 1
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
        elif c == "{" and (count := _COUNT.match(regex, i)):
            for digits in (n.lstrip("0") for n in count.groups() if n):
                if len(digits) > len(str(MAX_REPEAT)) or int(digits or 0) > MAX_REPEAT:  # int() of any length is slow
                    return f"it repeats {digits[:40]} times; at most {MAX_REPEAT} are accepted"
        i += 1
    if deepest > MAX_NESTING:
        return f"it nests {deepest} groups; at most {MAX_NESTING} are accepted"
    return None


def check_grammar_rules(grammar: str) -> None:
    """An EBNF grammar defines at most MAX_RULES rules (each `::=` counts, a literal one too: an upper bound)."""
    rules = grammar.count("::=")
    if rules > MAX_RULES:
        raise ValueError(f"grammar has {rules} rules; at most {MAX_RULES} are accepted")
