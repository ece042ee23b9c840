"""Structured outputs through the engine on the random tiny models: every output parses and validates, greedy
and sampled, batched with unconstrained requests, across preemption, n > 1 and prefix caching; a grammar that
fails fails its request only."""

import json
import os
import re
import sys

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("xgrammar")

from tiffin import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from tiffin.engine.structured.formats import FORMATS  # noqa: E402

MAX_TOKENS = 960  # above the longest document the generated schemas allow, whitespace runs included
# Outputs of test_generated_schemas_always_validate: 8 schemas an example, each greedy and with SEEDS seeds
SCHEMA_EXAMPLES = int(os.environ.get("TIFFIN_SCHEMA_EXAMPLES", 3))
SEEDS = int(os.environ.get("TIFFIN_SCHEMA_SEEDS", 1))
NAMES = st.sampled_from(["id", "name", "kind", "tags", "size", "items", "when", "x"])


def _bounded_number():
    def build(lo, span, integer, exclusive):
        schema = {"type": "integer" if integer else "number", "minimum": lo, "maximum": lo + span}
        if exclusive and span > 1:
            schema = {**schema, "exclusiveMinimum": schema.pop("minimum")}
        return schema

    return st.builds(build, st.integers(-50, 50), st.integers(0, 1000), st.booleans(), st.booleans())


def _bounded_string():
    lengths = st.tuples(st.integers(0, 3), st.integers(0, 5)).map(lambda t: (t[0], t[0] + t[1]))
    return st.one_of(
        lengths.map(lambda t: {"type": "string", "minLength": t[0], "maxLength": t[1]}),
        st.sampled_from(["^[a-z]{1,6}$", "^[0-9]{3}-[0-9]{2}$", "^(yes|no)$"]).map(
            lambda p: {"type": "string", "pattern": p}
        ),
        st.sampled_from(sorted(FORMATS)).map(lambda f: {"type": "string", "format": f}),
    )


LEAVES = st.one_of(
    _bounded_number(),
    _bounded_string(),
    st.lists(
        st.one_of(st.integers(-9, 99), st.sampled_from(["a", "bc", "ü"]), st.none()),
        min_size=1,
        max_size=4,
        unique=True,
    ).map(lambda values: {"enum": values}),
    st.sampled_from([{"type": "boolean"}, {"type": "null"}, {"const": "fixed"}]),
)


def _objects(children):
    return st.dictionaries(NAMES, children, min_size=1, max_size=3).flatmap(
        lambda props: st.sets(st.sampled_from(sorted(props))).map(
            lambda required: {"type": "object", "properties": props, "required": sorted(required)}
        )
    )


def _arrays(children):
    return st.tuples(children, st.integers(0, 2), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]}
    )


def _maps(children):
    """Objects of short free property names, bounded by minProperties/maxProperties."""
    return st.tuples(children, st.integers(0, 1), st.integers(0, 2)).map(
        lambda t: {
            "type": "object",
            "patternProperties": {"^[a-z]{1,3}$": t[0]},
            "minProperties": t[1],
            "maxProperties": t[1] + t[2],
        }
    )


def _any_of(children):
    return st.lists(children, min_size=2, max_size=2).map(lambda subs: {"anyOf": subs})


# Nested objects, arrays with min/max items, enums, anyOf, bounded numbers, required and optional properties,
# string lengths, patterns and formats: every document they allow fits in MAX_TOKENS.
SCHEMAS = _objects(
    st.recursive(
        LEAVES,
        lambda children: st.one_of(_objects(children), _arrays(children), _maps(children), _any_of(children)),
        max_leaves=4,
    )
)


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model("qwen2"), num_kv_blocks=512, max_num_seqs=64)


def _check(output, schema) -> dict:
    assert output.finish_reason == "stop", (output.finish_reason, output.text)
    doc = json.loads(output.text)
    jsonschema.validate(doc, schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    return doc


def _unbounded(schema: dict) -> bool:
    """Whether a document of `schema` may be of any length: formats with no length limit (an email's local part,
    a time's fraction of a second), which a random model may write until max_tokens."""
    return any(f'"format": "{f}"' in json.dumps(schema) for f in ("email", "time", "date-time"))


def test_generated_schemas_always_validate(llm):
    """Each schema greedy and compact, and sampled at temperature 1.0 with whitespace (SEEDS seeds), in one batch;
    every output validated by jsonschema with its format checker, but those of unbounded formats cut at max_tokens
    (at most a tenth). TIFFIN_SCHEMA_EXAMPLES and TIFFIN_SCHEMA_SEEDS scale it: 80 and 7 give 5,120 outputs."""
    tally = {"valid": 0, "cut": 0}

    @settings(max_examples=SCHEMA_EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.lists(SCHEMAS, min_size=8, max_size=8))
    def check(schemas):
        params = [
            SamplingParams(
                temperature=temperature,
                seed=seed,
                max_tokens=MAX_TOKENS,
                structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=compact),
            )
            for i, schema in enumerate(schemas)
            for temperature, compact, seed in [(0, True, i)] + [(1.0, False, i * SEEDS + s) for s in range(SEEDS)]
        ]
        outs = llm.generate(["Answer in JSON:"] * len(params), params, use_tqdm=False)
        for out, p in zip(outs, params):
            output, schema = out.outputs[0], p.structured_outputs.json
            if output.finish_reason == "length" and _unbounded(schema):
                tally["cut"] += 1
            else:
                _check(output, schema)
                tally["valid"] += 1

    check()
    assert tally["cut"] <= (tally["valid"] + tally["cut"]) // 10, tally
    print(f"generated schemas: {tally['valid']} outputs valid, {tally['cut']} cut at max_tokens", file=sys.stderr)


def test_regex_and_choice_with_unconstrained_neighbours(llm):
    regex = r"[A-Z][a-z]{2,5} \d{1,3}(\.\d)?"
    choices = ["red", "green", "blue and yellow"]
    params = [
        SamplingParams(temperature=t, seed=1, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=regex))
        for t in (0, 1.0)
    ] + [
        SamplingParams(temperature=t, seed=2, max_tokens=40, structured_outputs=StructuredOutputsParams(choice=choices))
        for t in (0, 1.0)
    ]
    params.append(SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))  # unconstrained, same batch
    outs = [o.outputs[0] for o in llm.generate(["Pick one:"] * len(params), params, use_tqdm=False)]
    for o in outs[:2]:
        assert o.finish_reason == "stop" and re.fullmatch(regex, o.text), o.text
    for o in outs[2:4]:
        assert o.finish_reason == "stop" and o.text in choices
    assert len(outs[4].token_ids) == 20
    plain = llm.generate(["Pick one:"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert plain[0].outputs[0].token_ids == outs[4].token_ids  # the masks touched only their own rows


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
    },
    "required": ["name", "scores"],
}


def test_n_samples_and_ignore_eos_end_with_the_grammar(llm):
    so = StructuredOutputsParams(json=SCHEMA)
    out = llm.generate(
        "JSON:", SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=200, ignore_eos=True, structured_outputs=so)
    )[0]
    assert len({o.text for o in out.outputs}) > 1
    for o in out.outputs:
        _check(o, SCHEMA)


def test_strings_come_back_as_the_characters_the_grammar_counted(llm):
    """Sampled freely, the byte-level vocabulary spells bytes that xgrammar alone takes for one character
    (F0 87 B0 91, not UTF-8): one output in 256 came back as 7 characters, 4 of them U+FFFD."""
    schema = {"type": "array", "prefixItems": [{"type": "string", "maxLength": 4}], "items": False, "minItems": 1}
    so = StructuredOutputsParams(json=schema)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=60, structured_outputs=so) for i in range(256)]
    for out in llm.generate(["x"] * len(params), params, use_tqdm=False):
        assert "\ufffd" not in out.outputs[0].text
        _check(out.outputs[0], schema)


def test_preemption_rebuilds_grammar_state(tiny_model):
    """A KV cache too small for the batch preempts requests; their outputs match an unpreempted run."""
    so = StructuredOutputsParams(json=SCHEMA)
    params = [SamplingParams(temperature=0, max_tokens=100, structured_outputs=so)] * 6
    prompts = [f"Record {i} as JSON, then stop." for i in range(6)]
    roomy = LLM(tiny_model("llama"), num_kv_blocks=256)
    want = [o.outputs[0].text for o in roomy.generate(prompts, params, use_tqdm=False)]
    tight = LLM(tiny_model("llama"), num_kv_blocks=30, block_size=4, enable_prefix_caching=True)
    got = tight.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].text for o in got] == want
    for o in got:
        _check(o.outputs[0], SCHEMA)


def test_grammar_error_fails_only_its_request(llm, monkeypatch):
    from tiffin.engine.structured.backend import GrammarState

    verdict = GrammarState.verdict
    monkeypatch.setattr(
        GrammarState, "verdict", lambda self, ids: ("error", "boom") if len(ids) == 3 else verdict(self, ids)
    )
    so = StructuredOutputsParams(choice=["abcdefgh"], disable_any_whitespace=True)
    outs = llm.generate(
        ["a", "b"],
        [
            SamplingParams(temperature=0, max_tokens=10, structured_outputs=so),
            SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        ],
        use_tqdm=False,
    )
    assert outs[0].outputs[0].finish_reason == "error" and outs[0].outputs[0].stop_reason == "boom"
    assert len(outs[1].outputs[0].token_ids) == 5
    monkeypatch.undo()
    assert (
        llm.generate("a", SamplingParams(max_tokens=10, structured_outputs=so), use_tqdm=False)[0].outputs[0].text
        == "abcdefgh"
    )


def test_min_tokens_is_refused_with_a_grammar():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(choice=["a"]))
    with pytest.raises(ValueError, match="structured_outputs must be"):
        SamplingParams(structured_outputs={"choice": ["a"]})


def test_a_grammar_past_its_deadline_fails_only_its_request(tiny_model, monkeypatch):
    from structured_specs import slow_compiles

    release = slow_compiles(monkeypatch)
    llm = LLM(tiny_model("llama"), num_kv_blocks=64, grammar_compile_timeout=0.3)
    so = StructuredOutputsParams(choice=["late"])
    params = [SamplingParams(max_tokens=5, structured_outputs=so), SamplingParams(max_tokens=3, ignore_eos=True)]
    try:
        outs = [o.outputs[0] for o in llm.generate(["a", "b"], params, use_tqdm=False)]
    finally:
        release.set()
    assert outs[0].finish_reason == "error" and "grammar_compile_timeout=0.3" in outs[0].stop_reason
    assert len(outs[1].token_ids) == 3
