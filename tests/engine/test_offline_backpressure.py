"""The offline `LLM` never fails a call because of a serving bound (issue #50): max_waiting_requests and the
grammar compile queue (MAX_PENDING), which a server answers with 429, hold requests back until the engine has
room; outputs come back in input order, and a bad prompt still raises, naming it, before anything runs. The
engine itself still refuses past its bounds (QueueFull), as servers need."""

import json
import threading

import jsonschema
import pytest

pytest.importorskip("xgrammar")

from tiffin import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from tiffin.engine.errors import QueueFull  # noqa: E402
from tiffin.engine.structured import backend as backend_module  # noqa: E402


def _schema(i: int) -> dict:
    """A small object schema, distinct per `i` (so each is a compile of its own)."""
    key = f"k{i}"
    return {
        "type": "object",
        "properties": {key: {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": [key],
        "additionalProperties": False,
    }


def test_a_thousand_structured_prompts_in_one_call(tiny_model):
    """The issue's case, scaled: 1,000 prompts, each with one of 500 schemas, far more compiles than MAX_PENDING.
    Before: QueueFull ("64 structured-outputs grammars are compiling") and no outputs."""
    llm = LLM(tiny_model("llama"), num_kv_blocks=40)
    count, distinct = 1000, 500
    assert distinct > backend_module.MAX_PENDING
    schemas = [_schema(i % distinct) for i in range(count)]
    params = [
        SamplingParams(
            temperature=1.0,
            seed=i,
            max_tokens=40,
            structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True),
        )
        for i, schema in enumerate(schemas)
    ]
    prompts = [f"Record {i} as JSON:" for i in range(count)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    for out, schema in zip(outs, schemas):
        output = out.outputs[0]
        assert out.error is None and output.finish_reason == "stop", (out.error, output)
        jsonschema.validate(json.loads(output.text), schema)
    assert not llm.llm_engine.has_unfinished_requests()


def test_more_prompts_than_max_waiting_requests(tiny_model):
    """Every prompt answered, in input order, as an unbounded engine answers it (greedy); n counts its samples."""
    prompts = [f"prompt number {i}" for i in range(30)]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=1 + (i % 3 == 0)) for i in range(30)]
    bounded = LLM(tiny_model("llama"), num_kv_blocks=64, max_num_seqs=2, max_waiting_requests=4)
    got = bounded.generate(prompts, params, use_tqdm=False)
    want = LLM(tiny_model("llama"), num_kv_blocks=64, max_num_seqs=2).generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in got] == prompts
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    assert all(len(c.token_ids) == 6 for o in got for c in o.outputs)
    # pooling requests (encode/embed) take the same path
    pooled = bounded.embed(prompts, use_tqdm=False)
    assert [o.prompt_token_ids for o in pooled] == [o.prompt_token_ids for o in got]
    assert all(o.outputs.embedding for o in pooled)


def test_bad_input_still_fails_fast_by_name(tiny_model):
    llm = LLM(tiny_model("llama"), num_kv_blocks=64, max_num_seqs=2, max_waiting_requests=4)
    prompts = ["fine"] * 20 + [[10**9]] + ["fine"] * 5
    with pytest.raises(ValueError, match=r"prompt 20: prompt token ids must be integers in \[0, "):
        llm.generate(prompts, SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 1: a request of 5 sequences never fits max_waiting_requests=4"):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, n=5)], use_tqdm=False)
    stats = llm.llm_engine.stats()
    assert stats.prompt_tokens == 0 and stats.generation_tokens == 0  # nothing was queued, let alone run
    assert not llm.llm_engine.has_unfinished_requests()
    assert len(llm.generate(["a"] * 10, SamplingParams(max_tokens=2), use_tqdm=False)) == 10


def test_an_idle_engine_waits_out_compiles_an_earlier_call_left(tiny_model, monkeypatch):
    """The compile queue full of compiles no request waits for (an earlier call that raised): the call waits for
    room instead of raising QueueFull or spinning."""
    from structured_specs import slow_compiles

    monkeypatch.setattr(backend_module, "MAX_PENDING", 2)
    llm = LLM(tiny_model("llama"), num_kv_blocks=64)
    backend = llm.llm_engine.grammars()
    release = slow_compiles(monkeypatch, marker="stale")
    try:
        stale = [backend.compile(StructuredOutputsParams(choice=[f"stale{i}"])) for i in range(2)]
        assert backend._pending == 2  # full
        threading.Timer(0.5, release.set).start()
        so = StructuredOutputsParams(choice=["fresh"])
        outs = llm.generate(["a", "b"], SamplingParams(max_tokens=5, structured_outputs=so), use_tqdm=False)
    finally:
        release.set()
    assert [o.outputs[0].text for o in outs] == ["fresh", "fresh"]
    assert all(f.done() for f in stale)


def test_the_engine_still_refuses_past_its_bounds(tiny_model, monkeypatch):
    """What servers (AsyncLLMEngine, the plugin) meet: QueueFull, their 429, unchanged."""
    llm = LLM(tiny_model("llama"), num_kv_blocks=64, max_waiting_requests=2)
    engine = llm.llm_engine
    engine.add_request("a", "x", SamplingParams(max_tokens=2))
    engine.add_request("b", "x", SamplingParams(max_tokens=2))
    with pytest.raises(QueueFull, match="max_waiting_requests=2"):
        engine.add_request("c", "x", SamplingParams(max_tokens=2))
    engine.abort_request(["a", "b"])

    from structured_specs import slow_compiles

    monkeypatch.setattr(backend_module, "MAX_PENDING", 1)
    release = slow_compiles(monkeypatch)
    try:
        engine.add_request(
            "d", "x", SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(regex="1"))
        )
        with pytest.raises(QueueFull, match="grammars are compiling"):
            so = StructuredOutputsParams(regex="2")
            engine.add_request("e", "x", SamplingParams(max_tokens=2, structured_outputs=so))
        assert "e" not in engine.requests
    finally:
        release.set()
        engine.abort_request(["d"])
