"""Engine behaviour through the public API: sampling options end to end, errors, aborts, prefix caching."""

import pytest
import torch

from tiffin import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model("llama"), dtype="float32", num_kv_blocks=48)


def random_prompts(vocab, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(0, vocab, (n,), generator=g).tolist()} for n in lens]


def test_seeded_sampling_is_independent_of_the_batch(llm):
    prompts = random_prompts(llm.llm_engine.model_config.vocab_size, [5, 40, 17, 60])
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate(prompts[1], seeded, use_tqdm=False)[0].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    mixed = llm.generate(prompts, [other, seeded, other, other], use_tqdm=False)[1].outputs[0].token_ids
    assert alone == mixed
    reseeded = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=20, ignore_eos=True)
    assert llm.generate(prompts[1], reseeded, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_top_k_1_equals_greedy(llm):
    prompts = random_prompts(llm.llm_engine.model_config.vocab_size, [9, 33], seed=1)
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=15, ignore_eos=True), use_tqdm=False)
    top1 = llm.generate(
        prompts, SamplingParams(temperature=0.7, top_k=1, max_tokens=15, ignore_eos=True), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in top1]


def test_n_samples_share_a_prompt(llm):
    out = llm.generate(
        "Python is", SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True), use_tqdm=False
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_stop_string_across_tokens_and_stop_token_ids(llm):
    tok = llm.get_tokenizer()
    base = llm.generate("The function", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)[
        0
    ].outputs[0]
    pieces = [tok.decode(base.token_ids[: i + 1]) for i in range(len(base.token_ids))]
    # a stop string that begins inside one token's text and ends inside a later one
    i = next(i for i in range(2, len(pieces)) if len(pieces[i]) - len(pieces[i - 2]) >= 3 and len(pieces[i - 2]) > 1)
    stop = pieces[i][len(pieces[i - 2]) - 1 : len(pieces[i - 2]) + 2]
    start = base.text.index(stop)
    out = llm.generate(
        "The function", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (base.text[:start], "stop", stop)
    kept = llm.generate(
        "The function",
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=stop, include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == base.text[: start + len(stop)]
    by_id = llm.generate(
        "The function",
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[base.token_ids[4]]),
        use_tqdm=False,
    )[0]
    first = base.token_ids.index(base.token_ids[4])
    assert by_id.outputs[0].token_ids == base.token_ids[: first + 1]
    assert by_id.outputs[0].stop_reason == base.token_ids[4]


def test_logprobs_are_the_models(llm, tiny_model):
    from transformers import AutoModelForCausalLM

    prompt = random_prompts(llm.llm_engine.model_config.vocab_size, [12], seed=3)[0]
    out = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32)
    ids = prompt["prompt_token_ids"] + out.token_ids
    ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)[len(prompt["prompt_token_ids"]) - 1 : -1]
    for step, (token, lps) in enumerate(zip(out.token_ids, out.logprobs)):
        top = ref[step].topk(3)
        assert set(top.indices.tolist()) | {token} == set(lps)
        for tid, lp in lps.items():
            assert lp.logprob == pytest.approx(ref[step, tid].item(), abs=1e-4)
        assert lps[token].rank == 1


def test_chat_uses_the_template(llm):
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "Hello there"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt_token_ids == tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_bad_requests_fail_alone_and_leak_nothing(llm):
    engine = llm.llm_engine
    engine.add_request("ok", "Hello world", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    too_long = list(range(engine.max_model_len + 1))
    for bad in (too_long, [engine.model_config.vocab_size], [-1], [], {"nothing": 1}):
        with pytest.raises(ValueError):
            engine.add_request("bad", bad, SamplingParams())
    with pytest.raises(ValueError, match="KV cache"):  # fits the context, never the 48-block pool
        engine.add_request("huge", [1] * 900, SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok", "again", SamplingParams())
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].request_id == "ok" and len(outs[-1].outputs[0].token_ids) == 8
    assert engine.stats().kv_blocks_used == 0


def test_abort_frees_blocks_at_once(llm):
    engine = llm.llm_engine
    for i in range(4):
        engine.add_request(f"a{i}", [5] * (30 + i), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.stats().kv_blocks_used > 0
    engine.abort_request(["a0", "a2"])
    engine.abort_request("a1")
    assert engine.stats().num_running + engine.stats().num_waiting == 1
    engine.abort_request("a3")
    assert engine.stats().kv_blocks_used == 0 and not engine.has_unfinished_requests()


def test_prefix_caching_shares_blocks_and_keeps_outputs(tiny_model):
    from test_engine_parity import reference

    path = tiny_model("qwen2")
    g = torch.Generator().manual_seed(11)
    system = torch.randint(0, 2048, (100,), generator=g).tolist()
    prompts = [system + torch.randint(0, 2048, (n,), generator=g).tolist() for n in (3, 20, 41, 7, 16)]
    prompts.append(list(prompts[2]))  # an exact repeat: everything but the last token is cached
    expected = reference(path, prompts)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for args in ({"enable_prefix_caching": False}, {}, {"num_kv_blocks": 24}):
        llm = LLM(path, dtype="float32", **args)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:1]], params, use_tqdm=False)
        outs += llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected, args
        stats = llm.llm_engine.stats()
        assert stats.kv_blocks_used == 0
        if args.get("enable_prefix_caching", True):
            assert stats.prefix_cache_hits >= 5 * 96  # all but the first find the system prompt
            assert outs[-1].num_cached_tokens == (len(prompts[-1]) - 1) // 16 * 16
        else:
            assert stats.prefix_cache_hits == 0
        if "num_kv_blocks" in args:
            assert stats.num_preemptions > 0
