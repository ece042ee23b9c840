"""Structured outputs without a model: what is refused and why, grammars, the xgrammar backend's masks."""

import json
from types import SimpleNamespace

import jsonschema
import pytest
import torch

xgrammar = pytest.importorskip("xgrammar")

from xgrammar.testing import _is_grammar_accept_string as accepts  # noqa: E402

from tiffin.engine.structured.backend import GrammarBackend, GrammarState, apply_bitmask, fill_bitmask  # noqa: E402
from tiffin.engine.structured.params import StructuredOutputsParams, unenforced_keyword  # noqa: E402

I, S = {"type": "integer"}, {"type": "string"}
OBJ = {"type": "object", "properties": {"a": I}}

# (schema, the keyword refused, an instance the schema forbids that xgrammar's grammar would let through)
CHECK_FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER
REFUSED = [
    ({"type": "number", "multipleOf": 0.5}, "multipleOf", "1.3"),
    ({"type": ["number", "integer"], "multipleOf": 2}, "multipleOf", "3.5"),
    ({"type": "string", "format": "idn-email"}, "format", '"zz"'),
    ({"type": "string", "format": "regex"}, "format", '"("'),
    ({"type": "string", "contentEncoding": "base64"}, "contentEncoding", None),  # jsonschema: an annotation
    ({"type": "array", "items": I, "contains": {"const": 1}}, "contains", "[2]"),
    ({"type": "array", "items": I, "uniqueItems": True}, "uniqueItems", "[1, 1]"),
    ({"type": "integer", "not": {"const": 3}}, "not", "3"),
    ({"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 7}}, "if", "9"),
    ({**OBJ, "allOf": [{"required": ["a"]}]}, "allOf", "{}"),
    ({"type": "integer", "oneOf": [{"minimum": 5}, {"maximum": 6}]}, "oneOf", "5"),
    ({**OBJ, "propertyNames": {"maxLength": 0}}, "propertyNames", '{"a": 1}'),
    ({**OBJ, "properties": {"a": I, "b": I}, "dependentRequired": {"a": ["b"]}}, "dependentRequired", '{"a": 1}'),
    ({"type": "object", "required": ["a"]}, "required", "{}"),
    ({**OBJ, "additionalProperties": S, "required": ["a", "b"]}, "required", '{"a": 1}'),
    ({"minimum": 3}, "minimum", "1"),
    ({"maxLength": 3}, "maxLength", '"abcd"'),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "maxLength", '"aaaa"'),
    ({"type": "string", "format": "email", "maxLength": 5}, "maxLength", '"aaaa@bbbb.com"'),
    ({"type": "string", "format": "date", "pattern": "^2"}, "format", '"1999-01-01"'),
    ({"type": "string", "pattern": "^(?!a)[a-z]$"}, "pattern", '"a"'),  # xgrammar drops the lookahead
    ({"type": "string", "enum": ["abc"], "maxLength": 2}, "maxLength", '"abc"'),
    ({"type": "integer", "enum": [1, "a"]}, "enum", '"a"'),
    ({"anyOf": [I], "minimum": 3}, "minimum", "1"),
    ({"type": "integer", "anyOf": [{"type": "integer", "minimum": 3}, S]}, "type", '"x"'),
    ({"$ref": "#/$defs/x", "maximum": 3, "$defs": {"x": I}}, "maximum", "9"),
    ({"type": "object", "properties": {"deep": {"type": "array", "items": {"not": I}}}}, "not", '{"deep": [1]}'),
]
# (schema, instances it allows, instances it forbids): enforced in full.
ENFORCED = [
    ({"type": "integer", "multipleOf": 3}, ["6"], ["7"]),
    ({"type": "integer", "minimum": -5, "maximum": 1000}, ["-5", "1000"], ["1001", "-6"]),
    ({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}, ["0.5"], ["0", "1"]),
    ({"type": "string", "minLength": 2, "maxLength": 3}, ['"ab"'], ['"a"', '"abcd"', '"a\x1cb"']),
    ({"type": "string", "format": "date-time"}, ['"2020-01-01T00:00:00Z"'], ['"x"']),
    ({"type": "string", "format": "uuid"}, ['"123e4567-e89b-12d3-a456-426614174000"'], ['"x"']),
    ({"type": "string", "pattern": "^[a-c]+$"}, ['"abc"'], ['"abd"']),
    ({**OBJ, "required": ["a"]}, ['{"a": 1}'], ["{}", '{"a": "x"}', '{"a": 1, "b": 2}']),
    ({"type": "array", "items": I, "minItems": 1, "maxItems": 2}, ["[1]"], ["[]", "[1, 2, 3]"]),
    ({"type": "array", "prefixItems": [I], "items": S}, ['[1, "a"]'], ['["a"]']),
    ({"anyOf": [{"type": "integer", "minimum": 3}, {"type": "string", "maxLength": 1}]}, ["4", '"a"'], ["1", '"ab"']),
    ({"enum": [1, "a", None]}, ["1", '"a"', "null"], ["2"]),
    ({"$ref": "#/$defs/x", "$defs": {"x": I}}, ["1"], ['"a"']),
    ({"type": "integer", "title": "t", "description": "d", "default": 1, "examples": [1]}, ["1"], ['"a"']),
]


def _grammar(schema) -> "xgrammar.Grammar":
    return xgrammar.Grammar.from_json_schema(json.dumps(schema), strict_mode=True)


@pytest.mark.parametrize(("schema", "keyword", "invalid"), REFUSED)
def test_refused_keywords_are_ones_xgrammar_would_not_enforce(schema, keyword, invalid):
    if invalid is not None:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(json.loads(invalid), schema, format_checker=CHECK_FORMATS)
        assert accepts(_grammar(schema), invalid)
    assert unenforced_keyword(schema)[0] == keyword
    with pytest.raises(ValueError, match=f"keyword '{keyword}'"):
        StructuredOutputsParams(json=schema)


@pytest.mark.parametrize(("schema", "valid", "invalid"), ENFORCED)
def test_accepted_schemas_are_enforced(schema, valid, invalid):
    params = StructuredOutputsParams(json=schema)
    grammar = params.xgrammar_grammar
    for text in valid:
        jsonschema.validate(json.loads(text), schema)
        assert accepts(grammar, text), text
    for text in invalid:
        assert not accepts(grammar, text), text


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of"),
        ({"regex": "a", "choice": ["a"]}, "exactly one of"),
        ({"json": "{bad"}, "json is not valid JSON"),
        ({"json": {"type": "foo"}}, "invalid JSON schema at #/type"),
        ({"json": {"type": "array", "minItems": 1}}, "json is invalid: minItems"),
        ({"regex": "a(b"}, "regex is invalid: .*parenthesis"),
        ({"grammar": "root ::= foo"}, 'grammar is invalid: .*"foo" is not defined'),
        ({"choice": []}, "choice must be a non-empty list"),
        ({"choice": ["a", 1]}, "choice must be a non-empty list"),
    ],
)
def test_invalid_params_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=f"^structured_outputs: .*{message}"):
        StructuredOutputsParams(**kwargs)


def test_same_spec_same_key():
    a = StructuredOutputsParams(json={"type": "object", "properties": {"a": I, "b": S}})
    b = StructuredOutputsParams(json=json.dumps({"properties": {"b": S, "a": I}, "type": "object"}))
    assert a.key == b.key
    assert a.key != StructuredOutputsParams(json=a.json, disable_any_whitespace=True).key


@pytest.fixture(scope="module")
def backend(tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model("llama"))
    return GrammarBackend(tokenizer, len(tokenizer), {3}, cache_size=2), tokenizer


def test_backend_masks_rows_and_caches_bounded(backend):
    backend, tokenizer = backend
    choice = StructuredOutputsParams(choice=["yes", "no"])
    assert backend.compile(choice) is backend.compile(choice)
    for i in range(3):
        backend.compile(StructuredOutputsParams(regex=f"[0-9]{{{i + 1}}}"))
    assert len(backend._cache) == 2 and choice.key not in backend._cache
    seqs = [SimpleNamespace(grammar=None), SimpleNamespace(grammar=GrammarState(backend.compile(choice)), ahead=0)]
    seqs += [seqs[0]]
    seqs[1].output_token_ids = []
    logits = torch.zeros(3, len(tokenizer))
    apply_bitmask(logits, fill_bitmask(seqs, len(tokenizer)))
    assert torch.isfinite(logits[[0, 2]]).all()  # unconstrained rows untouched
    allowed = torch.isfinite(logits[1]).nonzero()[:, 0].tolist()
    assert allowed and all("yes".startswith(t) or "no".startswith(t) for t in tokenizer.convert_ids_to_tokens(allowed))


def test_state_rebuilds_from_tokens_and_terminates_on_eos(backend):
    backend, tokenizer = backend
    state = GrammarState(backend.compile(StructuredOutputsParams(choice=["yes", "no"])))
    tokens = tokenizer.encode("yes", add_special_tokens=False) + [3]
    assert state.verdict(tokens[:-1]) is None and not state.terminated
    state.drop()
    assert state.verdict(tokens) == ("stop", None) and state.num_accepted == len(tokens)
    rejected = GrammarState(state.compiled)
    assert rejected.verdict(tokenizer.encode("maybe", add_special_tokens=False))[0] == "error"


def test_compile_failure_is_reported_on_the_state(backend):
    backend, _ = backend
    params = StructuredOutputsParams(choice=["x"])
    params._grammar = None  # what a failed compile looks like
    params.key = b"broken"
    state = GrammarState(backend.compile(params))
    state.compiled.exception()
    assert state.ready and state.error.startswith("grammar compilation failed")
