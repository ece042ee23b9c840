"""Reasoning models in the engine, on the tiny thinking model (its markers split by BPE, or single added tokens):
a thinking budget forces the end marker after exactly that many thinking tokens, greedy or sampled, with or
without speculation and preemption; structured outputs constrain only the answer; num_reasoning_tokens counts the
thinking, its markers included."""

import json

import jsonschema
import pytest

from tiffin import LLM, SamplingParams, StructuredOutputsParams
from tiffin.engine.reasoning import split_reasoning

MESSAGES = [{"role": "user", "content": "Which is larger, 9.11 or 9.9?"}]
MAX_TOKENS = 24
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["answer"],
    "additionalProperties": False,
}
NGRAM = {"method": "ngram", "prompt_lookup_min": 1, "disable_by_batch_size": None}


@pytest.fixture(scope="module", params=[False, True], ids=["split-markers", "marker-tokens"])
def llm(request, thinking_model):
    return LLM(str(thinking_model(request.param)), num_kv_blocks=128)


def greedy(budget: int | None = None, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, thinking_token_budget=budget, **kw)


def chat(llm: LLM, params: SamplingParams, **template_kwargs):
    return llm.chat(MESSAGES, params, use_tqdm=False, chat_template_kwargs=template_kwargs)[0].outputs[0]


def check_forced(llm: LLM, out, budget: int) -> None:
    """The end marker's ids right after `budget` thinking tokens, the reasoning their text."""
    engine = llm.llm_engine
    end_ids = engine.think_end_ids
    assert out.token_ids[budget : budget + len(end_ids)] == end_ids
    reasoning, _ = split_reasoning(out.text, engine.reasoning, opened=True)
    assert reasoning == engine.tokenizer.decode(out.token_ids[:budget])
    assert out.num_reasoning_tokens == budget + len(end_ids)


@pytest.mark.parametrize("budget", [0, 3, 7])
def test_budget_forces_the_end_marker_after_its_tokens(llm, budget):
    free = chat(llm, greedy())
    out = chat(llm, greedy(budget, logprobs=1))
    check_forced(llm, out, budget)
    assert out.token_ids[:budget] == free.token_ids[:budget]  # the budget leaves the thinking before it alone
    assert len(out.token_ids) == MAX_TOKENS and len(out.logprobs) == MAX_TOKENS  # forced tokens count, and score
    forced = out.logprobs[budget]
    assert out.token_ids[budget] in forced


def test_without_a_budget_the_random_model_thinks_to_the_end(llm):
    out = chat(llm, greedy())
    assert llm.llm_engine.reasoning.end not in out.text
    assert out.num_reasoning_tokens == len(out.token_ids) == MAX_TOKENS


def test_thinking_off_neither_forces_nor_counts(llm):
    free = chat(llm, greedy(), enable_thinking=False)
    out = chat(llm, greedy(0), enable_thinking=False)
    assert out.token_ids == free.token_ids and out.num_reasoning_tokens == 0


def test_token_id_prompts_open_thinking_as_their_text_does(llm):
    prompt = llm.llm_engine.render_chat(MESSAGES)
    by_text = llm.generate(prompt, greedy(3), use_tqdm=False)[0].outputs[0]
    by_ids = llm.generate({"prompt_token_ids": prompt.token_ids}, greedy(3), use_tqdm=False)[0].outputs[0]
    assert by_ids.token_ids == by_text.token_ids
    check_forced(llm, by_ids, 3)


def test_a_sampled_request_is_forced_too(llm):
    outs = llm.chat(
        MESSAGES,
        SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True, thinking_token_budget=5),
        use_tqdm=False,
    )[0].outputs
    assert len({tuple(o.token_ids[:5]) for o in outs}) > 1
    for out in outs:
        check_forced(llm, out, 5)


def test_a_forced_token_wins_over_min_tokens(thinking_model):
    """The end marker, an added token here, is also a stop token that min_tokens bans: forced, and no stop."""
    llm = LLM(str(thinking_model(True)), num_kv_blocks=64)
    end_id = llm.llm_engine.think_end_ids[0]
    out = chat(llm, greedy(0, min_tokens=4, stop_token_ids=[end_id]))
    assert out.token_ids[0] == end_id and len(out.token_ids) == MAX_TOKENS
    stopped = chat(
        llm, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, thinking_token_budget=2, stop_token_ids=[end_id])
    )
    assert stopped.token_ids[-1] == end_id and stopped.stop_reason == end_id and len(stopped.token_ids) == 3


def structured(budget: int | None = 4) -> SamplingParams:
    so = StructuredOutputsParams(json=SCHEMA)
    return SamplingParams(temperature=0, max_tokens=120, thinking_token_budget=budget, structured_outputs=so)


def check_answer(llm: LLM, out, budget: int) -> None:
    assert out.finish_reason == "stop", (out.finish_reason, out.text)
    check_forced(llm, out, budget)
    _, answer = split_reasoning(out.text, llm.llm_engine.reasoning, opened=True)
    jsonschema.validate(json.loads(answer), SCHEMA)


def test_the_grammar_constrains_only_the_answer(llm):
    free = chat(llm, greedy())
    out = chat(llm, structured())
    check_answer(llm, out, 4)
    assert out.token_ids[:4] == free.token_ids[:4]  # the thinking is as unconstrained as without a grammar
    # a prompt that opens no thinking: the grammar from the first token, as for any model
    off = chat(llm, structured(), enable_thinking=False)
    assert off.num_reasoning_tokens == 0
    jsonschema.validate(json.loads(off.text), SCHEMA)


@pytest.mark.parametrize("marker_tokens", [False, True], ids=["split-markers", "marker-tokens"])
def test_structured_thinking_under_preemption_and_speculation(thinking_model, marker_tokens):
    """Greedy tokens match a roomy run's under a cache that preempts and under n-gram speculation, grammars
    rebuilt from their answers' tokens."""
    path = str(thinking_model(marker_tokens))
    prompts = [[{"role": "user", "content": f"Record {i} as JSON."}] for i in range(6)]
    params = [structured(budget) for budget in (0, 2, 4, 6, None, 3)]
    params[4] = greedy(5)  # beside the grammars, a plain budgeted request

    def run(**engine_args):
        llm = LLM(path, **engine_args)
        outs = [o.outputs[0] for o in llm.chat(prompts, params, use_tqdm=False)]
        return llm, outs

    roomy, want = run(num_kv_blocks=256)
    tight, preempted = run(num_kv_blocks=40, block_size=4)
    assert tight.llm_engine.scheduler.num_preemptions > 0
    spec, speculated = run(num_kv_blocks=256, speculative_config=NGRAM)
    assert spec.llm_engine.stats().spec_draft_tokens > 0
    for outs in (preempted, speculated):
        assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    for out, p in zip(want, params):
        if p.structured_outputs is not None:
            check_answer(roomy, out, p.thinking_token_budget)
        else:
            check_forced(roomy, out, p.thinking_token_budget)
