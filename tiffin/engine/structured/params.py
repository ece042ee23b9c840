"""What a request's output must match (vLLM's `StructuredOutputsParams`), checked when the request is made.

A JSON schema is enforced in full or refused. xgrammar, the backend, accepts every schema but enforces only
part of JSON Schema: some keywords it drops (with at most a log line), and on one schema node it applies one
family of keywords only ($ref, else anyOf, else enum/const, else the type's own keywords), dropping the
others. `unenforced_keyword` finds every such case, so that a request names the keyword in a 400 instead of
getting output that does not validate. The lists below were measured against xgrammar 0.2.9 and are checked
by tests/test_structured_outputs.py: each refused case lets through an instance the schema forbids.

xgrammar is imported on first use: `tiffin.plugin.service` imports this module and must stay light."""

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from tiffin.engine.errors import ParamError

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
# `format` values xgrammar turns into a grammar; it lets any string through for the others.
FORMATS = frozenset(
    {
        "date",
        "time",
        "date-time",
        "duration",
        "email",
        "hostname",
        "ipv4",
        "ipv6",
        "uri",
        "uri-reference",
        "uri-template",
        "uuid",
        "json-pointer",
        "relative-json-pointer",
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
            spec = self.structural_tag = _map_tag_schemas(
                _load_json(spec, "structural_tag"),
                lambda node: {**node, "json_schema": check_json_schema(node.get("json_schema"))},
            )
        elif self.kind == "choice" and (
            not isinstance(spec, list) or not spec or not all(isinstance(c, str) and c for c in spec)
        ):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        elif self.kind in ("regex", "grammar") and not isinstance(spec, str):
            raise ValueError(f"{self.kind} must be a string")
        text = json.dumps([self.kind, spec, self.disable_any_whitespace], sort_keys=True)
        self.key = hashlib.sha256(text.encode()).digest()
        self._grammar = _build_grammar(self.kind, spec, self.disable_any_whitespace)

    @property
    def xgrammar_grammar(self):
        """The tokenizer-independent `xgrammar.Grammar`, built (and so checked) when the params were made."""
        return self._grammar


def check_json_schema(schema: Any) -> dict | bool:
    """`schema` if it is a valid JSON schema whose every keyword the backend enforces; else ValueError."""
    from jsonschema import Draft202012Validator, exceptions, validators

    if not isinstance(schema, (dict, bool)):
        raise ValueError("the JSON schema must be an object or a boolean")
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
    for keyword, key, sub in _subschemas(schema):
        if key is None:
            node[keyword] = xgrammar_schema(sub)
        else:
            node[keyword] = container = node[keyword].copy()
            container[key] = xgrammar_schema(sub)
    return node


def _check_typed_node(schema: dict, path: str) -> tuple[str, str, str] | None:
    types = schema.get("type")
    types = {types} if isinstance(types, str) else set(types or ())
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
    """(keyword, name or index or None, subschema) of every place xgrammar reads a schema from.
    unevaluated*/additionalItems are left out: the grammar only writes what other keywords evaluate."""
    for keyword in ("properties", "patternProperties", "$defs", "definitions"):
        for name, sub in (schema.get(keyword) or {}).items():
            yield keyword, name, sub
    for keyword in ("additionalProperties", "items"):
        if isinstance(schema.get(keyword), dict):
            yield keyword, None, schema[keyword]
    for keyword in ("prefixItems", "anyOf"):
        for i, sub in enumerate(schema.get(keyword) or ()):
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
    if isinstance(spec, str):
        try:
            return json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    return spec


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
