"""Hostile structured-outputs specs without a model: refused by name before anything recursive or costly runs,
formats enforced by their real rule, remote references refused; the backend's compile pool, deadline and
byte-bounded cache."""

import json
import random
import re
import time

import jsonschema
import pytest
from structured_specs import ebnf_chain, nested_schema, ref_chain, slow_compiles

xgrammar = pytest.importorskip("xgrammar")

from tiffin.engine.structured.backend import GrammarBackend  # noqa: E402
from tiffin.engine.structured.params import FORMATS, StructuredOutputsParams  # noqa: E402

CHECK_FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER


ARRAYS_100_DEEP = json.loads('{"type": "array", "items": ' * 100 + '{"type": "integer"}' + "}" * 100)
# (kwargs, what the refusal names): each answered at once, before jsonschema, Python's re or xgrammar recurse or
# compile. Today's code raised RecursionError / OverflowError (500s), or accepted them and compiled for seconds.
HOSTILE = [
    ({"json": ARRAYS_100_DEEP}, "nests"),
    ({"json": nested_schema(100)}, "nests"),
    ({"json": "[" * 5000 + "]" * 5000}, "nests"),
    ({"json": {"type": "string", "pattern": "(" * 3000 + "a" + ")" * 3000}}, "'pattern'"),
    ({"json": {"type": "string", "pattern": "^a{99999999999999999999}$"}}, "'pattern'"),
    ({"json": {"type": "object", "patternProperties": {"(" * 500 + ")" * 500: {}}}}, "'patternProperties'"),
    ({"regex": "(" * 3000 + "a" + ")" * 3000}, "regex"),
    ({"json": ref_chain(2000)}, "$ref"),
    ({"json": ref_chain(1000, via="anyOf")}, "$ref"),
    ({"json": {"anyOf": [{"type": "integer"}] * 6000}}, "objects and arrays"),
    ({"json": {"anyOf": [{"type": "integer"}] * 200_000}}, "objects and arrays"),
    ({"grammar": ebnf_chain(3000)}, "rules"),
    ({"choice": [f"choice number {i}" for i in range(100_000)]}, "bytes"),
]


@pytest.mark.parametrize(("kwargs", "names"), HOSTILE, ids=lambda v: str(v)[:30] if isinstance(v, dict) else None)
def test_hostile_specs_are_refused_by_name_at_once(kwargs, names):
    started = time.monotonic()
    with pytest.raises(ValueError, match="^structured_outputs: ") as refused:
        StructuredOutputsParams(**kwargs)
    assert names in str(refused.value) and "at most" in str(refused.value), refused.value
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize(
    "ref", ["http://example.com/schema.json", "file:///etc/passwd", "other.json#/x", "#anchor", "urn:x:y"]
)
def test_references_outside_the_schema_are_refused(ref):
    """xgrammar let any JSON through for these: the schema they point to was never read."""
    with pytest.raises(ValueError, match=f"'\\$ref' at # cannot be enforced: {re.escape(repr(ref))}"):
        StructuredOutputsParams(json={"$ref": ref})
    nested = {"type": "object", "properties": {"a": {"$ref": ref}}, "required": ["a"]}
    with pytest.raises(ValueError, match="'\\$ref' at #/properties/a cannot be enforced"):
        StructuredOutputsParams(json=nested)


def test_local_references_and_recursion_within_the_limits_are_served():
    tree = {
        "$defs": {"node": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}},
        "$ref": "#/$defs/node",
    }
    for schema in (tree, ref_chain(30), ref_chain(15, via="anyOf"), nested_schema(30)):
        StructuredOutputsParams(json=schema)
    with pytest.raises(ValueError, match="'\\$ref' at #/properties/a cannot be enforced: .*does not resolve"):
        StructuredOutputsParams(json={"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}})


def _random_strings(params: StructuredOutputsParams, count: int, seed: int) -> list[str]:
    """`count` outputs of a random walk through the grammar over a one-character-per-token vocabulary."""
    vocab = [chr(c) for c in range(32, 127)] + ["</s>"]
    stop = len(vocab) - 1
    info = xgrammar.TokenizerInfo(vocab, stop_token_ids=[stop])
    compiled = xgrammar.GrammarCompiler(info, cache_enabled=False).compile_grammar(params.xgrammar_grammar)
    rng = random.Random(seed)
    bitmask = xgrammar.allocate_token_bitmask(1, len(vocab))
    out = []
    while len(out) < count:
        matcher, text = xgrammar.GrammarMatcher(compiled), ""
        while not matcher.is_terminated() and len(text) < 120:
            matcher.fill_next_token_bitmask(bitmask)
            words = bitmask[0].tolist()
            allowed = [i for i in range(len(vocab)) if words[i // 32] >> (i % 32) & 1]
            token = rng.choice(allowed)
            assert matcher.accept_token(token)
            text += "" if token == stop else vocab[token]
        if matcher.is_terminated():
            out.append(text)
    return out


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_accepted_format_only_produces_what_jsonschema_accepts(fmt):
    schema = {"type": "string", "format": fmt}
    assert fmt in CHECK_FORMATS.checkers, f"jsonschema cannot check {fmt!r}: an accepted format must be checkable"
    params = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    for text in _random_strings(params, 300, seed=len(fmt)):
        jsonschema.validate(json.loads(text), schema, format_checker=CHECK_FORMATS)


VALID_AND_INVALID = {
    "date": (["2024-02-29", "2000-02-29", "0001-01-01", "2023-12-31"], ["2024-02-31", "2023-02-29", "1900-02-29"]),
    "date-time": (["2024-02-29T23:59:59.5+01:00", "2023-01-31T00:00:00Z"], ["2023-02-30T00:00:00Z"]),
    "time": (["23:59:59Z", "00:00:00.123-12:30"], ["23:59:60Z", "24:00:00Z"]),
    "ipv4": (["1.2.3.4", "255.255.255.0", "0.0.0.0"], ["01.02.03.04", "256.1.1.1", "1.2.3"]),
    "ipv6": (
        ["::", "::1", "1:2:3:4:5:6:7:8", "fe80::1:2", "::ffff:1.2.3.4", "1:2:3:4:5:6:7::"],
        ["1::2::3", ":1", "::ffff:01.2.3.4"],
    ),
}


@pytest.mark.parametrize("fmt", sorted(VALID_AND_INVALID))
def test_formats_follow_the_real_rule(fmt):
    from xgrammar.testing import _is_grammar_accept_string as accepts

    grammar = StructuredOutputsParams(json={"type": "string", "format": fmt}).xgrammar_grammar
    valid, invalid = VALID_AND_INVALID[fmt]
    for value in valid:
        assert CHECK_FORMATS.conforms(value, fmt) and accepts(grammar, json.dumps(value)), value
    for value in invalid + (["0000-01-01"] if fmt == "date" else []):
        assert not CHECK_FORMATS.conforms(value, fmt) and not accepts(grammar, json.dumps(value)), value


@pytest.mark.parametrize("fmt", ["hostname", "uri", "uri-reference", "uri-template", "duration", "json-pointer"])
def test_formats_jsonschema_cannot_check_are_refused_by_name(fmt):
    with pytest.raises(ValueError, match=f"keyword 'format' at # cannot be enforced: format '{fmt}'"):
        StructuredOutputsParams(json={"type": "string", "format": fmt})


# --- the backend: compiles on a pool of workers, with a deadline; a cache bounded in bytes ---


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model("llama"))


def _backend(tokenizer, **kwargs) -> GrammarBackend:
    return GrammarBackend(tokenizer, len(tokenizer), {3}, **kwargs)


def test_a_grammar_with_no_possible_output_fails_its_compile(tokenizer):
    backend = _backend(tokenizer)
    failed = backend.compile(StructuredOutputsParams(grammar="root ::= root"))
    assert "allows no output" in str(failed.exception(timeout=30))
    assert backend.compile(StructuredOutputsParams(grammar='root ::= "ok"')).result(timeout=30) is not None


def test_the_cache_is_bounded_in_bytes_and_refuses_a_grammar_larger_than_it(tokenizer):
    lists = [[f"option {i} of list {n}" for i in range(400)] for n in range(6)]
    compiled = [_backend(tokenizer).compile(StructuredOutputsParams(choice=c)).result(30).compiled for c in lists]
    sizes = [c.memory_size_bytes for c in compiled]
    budget = int(2.5 * max(sizes))
    backend = _backend(tokenizer, cache_bytes=budget)
    for choices in lists:
        backend.compile(StructuredOutputsParams(choice=choices)).result(timeout=30)
    assert 0 < backend.cached_bytes <= budget and len(backend._cache) < len(lists)
    small = _backend(tokenizer, cache_bytes=min(sizes) // 2)
    too_big = small.compile(StructuredOutputsParams(choice=lists[0])).exception(timeout=30)
    assert isinstance(too_big, ValueError) and "grammar_cache_bytes" in str(too_big)
    assert small.cached_bytes == 0


def test_a_slow_compile_does_not_hold_back_the_next_one(tokenizer, monkeypatch):
    release = slow_compiles(monkeypatch, "slow-marker")
    backend = _backend(tokenizer)
    slow = backend.compile(StructuredOutputsParams(choice=["slow-marker"]))
    started = time.monotonic()
    backend.compile(StructuredOutputsParams(choice=["quick"])).result(timeout=30)
    assert time.monotonic() - started < 2 and not slow.done()
    release.set()
    assert slow.result(timeout=30) is not None


def test_a_queued_compile_nobody_waits_for_is_cancelled(tokenizer, monkeypatch):
    release = slow_compiles(monkeypatch)
    backend = _backend(tokenizer, workers=1)
    backend.compile(StructuredOutputsParams(choice=["first"]))  # holds the only worker
    queued_params = StructuredOutputsParams(choice=["queued"])
    queued = backend.compile(queued_params, waiter=True)
    backend.release(queued_params.key, queued)
    assert queued.cancelled() and queued_params.key not in backend._cache
    release.set()


def test_compiles_past_the_queue_bound_are_refused(tokenizer, monkeypatch):
    from tiffin.engine.errors import QueueFull
    from tiffin.engine.structured import backend as backend_module

    monkeypatch.setattr(backend_module, "MAX_PENDING", 2)
    release = slow_compiles(monkeypatch)
    backend = _backend(tokenizer, workers=1)
    pending = [backend.compile(StructuredOutputsParams(choice=[name])) for name in ("a", "b")]
    with pytest.raises(QueueFull, match="retry later"):
        backend.compile(StructuredOutputsParams(choice=["c"]))
    assert backend.compile(StructuredOutputsParams(choice=["a"])) is pending[0]  # waiting on a pending one is free
    release.set()
    assert all(f.result(timeout=30) is not None for f in pending)
    assert backend.compile(StructuredOutputsParams(choice=["c"])).result(timeout=30) is not None
