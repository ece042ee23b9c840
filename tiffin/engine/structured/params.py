"""What a request's output must match (vLLM's `StructuredOutputsParams`), checked when the request is made.

A JSON schema is enforced in full or refused. xgrammar, the backend, accepts every schema but enforces only
part of JSON Schema: some keywords it drops (with at most a log line), and on one schema node it applies one
family of keywords only ($ref, else anyOf, else enum/const, else the type's own keywords), dropping the
others. `unenforced_keyword` finds every such case, so that a request names the keyword in a 400 instead of
getting output that does not validate. The lists below were measured against xgrammar 0.2.9 and are checked
by tests/test_structured_outputs.py: each refused case lets through an instance the schema forbids. A `$ref` is
enforced only within the schema (xgrammar reads no other document, and let any JSON through in place of one);
a `format` only as `formats` enforces it.

A spec is refused, naming the limit, before anything recursive or costly reads it when it exceeds `limits`: so
checking it and building its grammar take bounded time (on a worker thread in a server: up to a second).

xgrammar is imported on first use: `tiffin.plugin.service` imports this module and must stay light."""

import hashlib
import json
import re
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from tiffin.engine.errors import ParamError
from tiffin.engine.structured import limits
from tiffin.engine.structured.formats import FORMATS, PATTERNS

# Keywords xgrammar accepts and then does not enforce (oneOf degrades to anyOf; allOf is dropped).
NOT_ENFORCED = frozenset(
    {
        "not",
        "if",
        "then",
        "else",
        "allOf",
        "oneOf",
        "contains",
        "minContains",
        "maxContains",
        "propertyNames",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "contentEncoding",
        "contentMediaType",
        "contentSchema",
        "$dynamicRef",
        "$recursiveRef",
    }
)
# Keywords that constrain one instance type; xgrammar applies them only on a node that declares its type.
TYPED_KEYWORDS = {
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    "string": ("minLength", "maxLength", "pattern", "format"),
    "array": ("items", "prefixItems", "minItems", "maxItems", "uniqueItems"),
    "object": ("properties", "required", "additionalProperties", "patternProperties", "minProperties", "maxProperties"),
}
_TYPE_OF_KEYWORD = {k: t for t, keywords in TYPED_KEYWORDS.items() for k in keywords}
_VALUE_KEYWORDS = ("type", "enum", "const", "anyOf", "$ref", *_TYPE_OF_KEYWORD)
# Consecutive whitespace characters the JSON grammars allow: room for indentation, while a model cannot stall
# in whitespace forever (vLLM's known failure with small models).
MAX_WHITESPACE_RUN = 16
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """Exactly one of json (a JSON schema, dict or text), regex, choice (the output is one of these strings),
    grammar (xgrammar EBNF), json_object (any JSON object) and structural_tag (xgrammar's structural tag)."""

    json: str | dict | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    disable_any_whitespace: bool = False  # JSON without optional whitespace
    kind: str = field(init=False, repr=False, compare=False)  # which of KINDS is given
    _grammar: Any = field(init=False, repr=False, compare=False)
    key: bytes = field(init=False, repr=False, compare=False)  # identifies the grammar: the compile cache key

    def __post_init__(self) -> None:
        try:
            self._check()
        except ValueError as e:
            raise ParamError("structured_outputs", f"structured_outputs: {e}") from None

    def _check(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"exactly one of {', '.join(KINDS)} is needed; got {given or 'none'}")
        self.kind = given[0]
        spec = getattr(self, self.kind)
        if self.kind == "json":
            spec = self.json = check_json_schema(_load_json(spec, "json"))
        elif self.kind == "structural_tag":
            tag = _load_json(spec, "structural_tag")
            limits.check_shape(tag, "structural_tag")
            spec = self.structural_tag = _map_tag_schemas(
                tag, lambda node: {**node, "json_schema": check_json_schema(node.get("json_schema"))}
            )
        elif self.kind == "choice":
            if not isinstance(spec, list) or not spec or not all(isinstance(c, str) and c for c in spec):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            limits.check_shape(spec, "choice")
        elif self.kind in ("regex", "grammar"):
            if not isinstance(spec, str):
                raise ValueError(f"{self.kind} must be a string")
            limits.check_text(spec, self.kind)
            if self.kind == "grammar":
                limits.check_grammar_rules(spec)
            elif problem := limits.regex_problem(spec):
                raise ValueError(f"regex: {problem}")
        text = json.dumps([self.kind, spec, self.disable_any_whitespace], sort_keys=True)
        self.key = hashlib.sha256(text.encode()).digest()
        self._grammar = _build_grammar(self.kind, spec, self.disable_any_whitespace)

    @property
    def xgrammar_grammar(self):
        """The tokenizer-independent `xgrammar.Grammar`, built (and so checked) when the params were made."""
        return self._grammar


def check_json_schema(schema: Any) -> dict | bool:
    """`schema` if it is a valid JSON schema within `limits` whose every keyword the backend enforces, every
    `$ref` within it; else ValueError. Its size, nesting and regexes are checked first, without recursing:
    jsonschema's check recurses, and compiles the regexes with Python's re."""
    from jsonschema import Draft202012Validator, exceptions, validators

    if not isinstance(schema, (dict, bool)):
        raise ValueError("the JSON schema must be an object or a boolean")
    limits.check_shape(schema, "the JSON schema")
    limits.check_schema_patterns(schema)
    # before jsonschema's check, which takes a few tenths of a second on the largest schemas within `limits`
    problem = _reference_problem(schema)
    if problem is None:
        try:
            validators.validator_for(schema, default=Draft202012Validator).check_schema(schema)
        except exceptions.SchemaError as e:
            where = "/".join(map(str, e.absolute_path))
            raise ValueError(f"invalid JSON schema at #/{where}: {e.message}") from None
        problem = unenforced_keyword(schema)
    if problem is not None:
        keyword, path, why = problem
        raise ValueError(f"JSON schema keyword '{keyword}' at {path} cannot be enforced: {why}")
    return schema


def unenforced_keyword(schema: Any, path: str = "#") -> tuple[str, str, str] | None:
    """(keyword, where, why) of the first keyword in `schema` that xgrammar would not enforce, else None."""
    if not isinstance(schema, dict):
        return None
    present = [k for k in schema if k in NOT_ENFORCED]
    if present:
        return present[0], path, "the xgrammar backend does not support it"
    if schema.get("uniqueItems") is True:
        return "uniqueItems", path, "the xgrammar backend does not support it"
    # One family of value keywords per node: xgrammar drops the rest.
    for leader in ("$ref", "anyOf", "enum", "const"):
        if leader in schema:
            allowed = {leader, "type"} if leader in ("enum", "const") else {leader}
            extra = [k for k in _VALUE_KEYWORDS if k in schema and k not in allowed]
            if extra:
                return extra[0], path, f"the xgrammar backend ignores it next to '{leader}'"
            if leader in ("enum", "const") and "type" in schema:
                return _check_values_match_type(schema, leader, path)
            break
    else:
        problem = _check_typed_node(schema, path)
        if problem is not None:
            return problem
    for keyword, key, sub in _subschemas(schema):
        problem = unenforced_keyword(sub, f"{path}/{keyword}" if key is None else f"{path}/{keyword}/{key}")
        if problem is not None:
            return problem
    return None


def xgrammar_schema(schema: Any) -> Any:
    """`schema` as handed to xgrammar: its grammar for minLength/maxLength lets raw control characters into
    the string (invalid JSON), so a length becomes the equivalent pattern, whose grammar keeps them out."""
    if not isinstance(schema, dict):
        return schema
    node = dict(schema)
    if ("minLength" in node or "maxLength" in node) and "pattern" not in node and "format" not in node:
        node["pattern"] = f"^[^\\x00-\\x1f]{{{node.pop('minLength', 0)},{node.pop('maxLength', '')}}}$"
    if node.get("format") in PATTERNS and "string" in _types(node):  # xgrammar's own lets invalid values through
        node["pattern"] = f"^{PATTERNS[node.pop('format')]}$"
    for keyword, key, sub in _subschemas(schema):
        if key is None:
            node[keyword] = xgrammar_schema(sub)
        else:
            node[keyword] = container = node[keyword].copy()
            container[key] = xgrammar_schema(sub)
    return node


def _types(schema: dict) -> set[str]:
    types = schema.get("type")
    return {types} if isinstance(types, str) else set(types or ())


def _check_typed_node(schema: dict, path: str) -> tuple[str, str, str] | None:
    types = _types(schema)
    if "integer" in types:
        types.add("number")
    for keyword in schema:
        if keyword in _TYPE_OF_KEYWORD and not types:
            return keyword, path, "the xgrammar backend applies it only where the schema declares 'type'"
    if "multipleOf" in schema and types & {"number"} and schema.get("type") not in ("integer", ["integer"]):
        return "multipleOf", path, "the xgrammar backend supports it for integers only"
    if "string" in types:
        fmt = schema.get("format")
        if fmt is not None and fmt not in FORMATS:
            return "format", path, f"format {fmt!r} is not supported (supported: {', '.join(sorted(FORMATS))})"
        shaped = [k for k in ("pattern", "format") if k in schema]
        length = [k for k in ("minLength", "maxLength") if k in schema]
        if len(shaped) == 2:
            return "format", path, "the xgrammar backend ignores it next to 'pattern'"
        if shaped and length:
            return length[0], path, f"the xgrammar backend ignores it next to '{shaped[0]}'"
        if "pattern" in schema:
            error = _regex_error(schema["pattern"])
            if error:
                return "pattern", path, error
    if "object" in types:
        missing = [name for name in schema.get("required", ()) if name not in schema.get("properties", {})]
        if missing:
            return (
                "required",
                path,
                f"{missing[0]!r} is not in 'properties', and the xgrammar backend enforces only those",
            )
    return None


def _check_values_match_type(schema: dict, leader: str, path: str) -> tuple[str, str, str] | None:
    from jsonschema import Draft202012Validator

    values = schema[leader] if leader == "enum" else [schema[leader]]
    check = Draft202012Validator({"type": schema["type"]})
    bad = [v for v in values if not check.is_valid(v)]
    if bad:
        return leader, path, f"the value {bad[0]!r} does not match 'type', which the xgrammar backend does not check"
    return None


def _subschemas(schema: dict):
    """(keyword, name or index or None, subschema) of every place xgrammar reads a schema from; a keyword whose
    value is of the wrong kind has none (jsonschema's check refuses it, possibly after `_reference_problem`).
    unevaluated*/additionalItems are left out: the grammar only writes what other keywords evaluate."""
    for keyword in ("properties", "patternProperties", "$defs", "definitions"):
        if isinstance(schema.get(keyword), dict):
            for name, sub in schema[keyword].items():
                yield keyword, name, sub
    for keyword in ("additionalProperties", "items"):
        if isinstance(schema.get(keyword), dict):
            yield keyword, None, schema[keyword]
    for keyword in ("prefixItems", "anyOf"):
        if isinstance(schema.get(keyword), list):
            for i, sub in enumerate(schema[keyword]):
                yield keyword, i, sub


def _map_tag_schemas(tag: Any, fn) -> Any:
    """A structural tag with each of its JSON-schema formats replaced by `fn(format)`."""
    if isinstance(tag, list):
        return [_map_tag_schemas(value, fn) for value in tag]
    if not isinstance(tag, dict):
        return tag
    if tag.get("type") == "json_schema":
        return fn(tag)
    return {key: _map_tag_schemas(value, fn) for key, value in tag.items()}


def _load_json(spec, name: str):
    return limits.load_json(spec, name) if isinstance(spec, str) else spec


_OUTSIDE, _MISSING = object(), object()


def _resolve(schema: Any, ref: str) -> Any:
    """The node of `schema` that `ref` names ('#', or '#' and a JSON pointer, percent-decoded); _OUTSIDE for a
    reference to another document or an anchor, _MISSING for a pointer to nothing."""
    if ref != "#" and not ref.startswith("#/"):
        return _OUTSIDE
    node = schema
    for token in ref[2:].split("/") if ref != "#" else ():
        token = urllib.parse.unquote(token).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return _MISSING
    return node


def _reference_problem(schema: Any) -> tuple[str, str, str] | None:
    """('$ref', where, why) for a `$ref` that points outside `schema` or to nothing, or past which schemas nest
    more than MAX_NESTING deep, counting a `$ref`'s target as its child (xgrammar's conversion grows as the cube
    of a chain of `$ref`s; the JSON itself nests no deeper than that already); else None. Iterative, and each
    node's height is walked once; a `$ref` back to a schema on the way down loops the grammar, not deepens it."""
    heights: dict[int, int] = {}  # id(node) -> schema levels from it down
    stack: list[list] = []  # [node, path, children not yet walked, height of the tallest child walked]

    def enter(node: dict, path: str) -> tuple[str, str, str] | None:
        children = [(sub, f"{path}/{k}" if key is None else f"{path}/{k}/{key}") for k, key, sub in _subschemas(node)]
        ref = node.get("$ref")
        if isinstance(ref, str):
            target = _resolve(schema, ref)
            if target is _OUTSIDE:
                return "$ref", path, f"{ref!r} is not within the schema ('#/...'): xgrammar reads no other document"
            if target is _MISSING:
                return "$ref", path, f"{ref!r} does not resolve within the schema"
            children.append((target, ref))
        stack.append([node, path, children, 0])
        return None

    problem = enter(schema, "#") if isinstance(schema, dict) else None
    while stack and problem is None:
        top = stack[-1]
        if not top[2]:
            stack.pop()
            heights[id(top[0])] = top[3] + 1
            if stack:
                stack[-1][3] = max(stack[-1][3], top[3] + 1)
            continue
        child, path = top[2].pop()
        if not isinstance(child, dict) or any(child is entry[0] for entry in stack):
            continue
        height = heights.get(id(child))
        if len(stack) + (height or 1) > limits.MAX_NESTING:
            limit = limits.MAX_NESTING
            why = f"schemas nest more than {limit} deep through it (a $ref target counts); at most {limit} are accepted"
            return "$ref", path, why
        if height is None:
            problem = enter(child, path)
        else:
            top[3] = max(top[3], height)
    return problem


def _regex_error(pattern: str) -> str | None:
    """Why xgrammar cannot enforce `pattern`, or None. Inside a JSON schema xgrammar drops what it cannot
    express (lookarounds) with only a log line; compiling the pattern alone turns that into an error."""
    import xgrammar

    try:
        xgrammar.Grammar.from_regex(pattern)
    except RuntimeError as e:
        return _xgrammar_message(e)
    return None


_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def _xgrammar_message(e: Exception) -> str:
    """xgrammar's error text without its log prefix (time, source file and line)."""
    return _XGRAMMAR_PREFIX.sub("", str(e).strip())


def _build_grammar(kind: str, spec, disable_any_whitespace: bool):
    import xgrammar

    whitespace = (
        {"any_whitespace": False}
        if disable_any_whitespace
        else {"any_whitespace": True, "max_whitespace_cnt": MAX_WHITESPACE_RUN}
    )
    try:
        if kind == "json":
            return xgrammar.Grammar.from_json_schema(json.dumps(xgrammar_schema(spec)), strict_mode=True, **whitespace)
        if kind == "json_object":  # strict mode would allow only {}
            return xgrammar.Grammar.from_json_schema('{"type": "object"}', strict_mode=False, **whitespace)
        if kind == "regex":
            return xgrammar.Grammar.from_regex(spec)
        if kind == "choice":
            return xgrammar.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec))
        if kind == "grammar":
            return xgrammar.Grammar.from_ebnf(spec)
        whitespace_run = 0 if disable_any_whitespace else MAX_WHITESPACE_RUN
        spec = _map_tag_schemas(
            spec,
            lambda node: {
                "max_whitespace_cnt": whitespace_run,
                **node,
                "json_schema": xgrammar_schema(node["json_schema"]),
            },
        )
        return xgrammar.Grammar.from_structural_tag(json.dumps(spec))
    except (RuntimeError, ValueError) as e:  # pydantic's ValidationError (a bad structural tag) is a ValueError
        raise ValueError(f"{kind} is invalid: {_xgrammar_message(e)}") from None
