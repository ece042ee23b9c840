"""Runs of an engine on the CUDA path under the CUDA emulation (`tiffin.testing.cuda_emulation`): one batch of
requests that shrinks step by step, an eager engine's outputs to compare a graphed one's with. Shared by
test_cuda_graphs and test_cuda_graphs_quantized."""

import pytest

from tiffin import LLM, SamplingParams

# 7, 16, 4 and 5 tokens (the tiny llama's): rows of distinct positions, the second's decodes in its second KV block;
# short, as a prefill costs by the token under the interpreter
PROMPTS = ["Hi tiffin", "The quick brown fox jumps", "1 2 3", "Once upon"]


def generate(llm: LLM, lora_request: list | None = None) -> list:
    """One batch that shrinks as its requests end (decode batches of 4, 3, 2, 1: padded and exact graph sizes):
    greedy with logprobs, greedy, and seeded samples -> (tokens, logprobs) per request."""
    params = [
        SamplingParams(temperature=0, max_tokens=5, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, max_tokens=4, seed=1, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=2, seed=2, ignore_eos=True),
    ]
    outs = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=lora_request)
    return [(c.token_ids, c.logprobs) for o in outs for c in o.outputs]


def assert_same(got: list, want: list) -> None:
    for (got_ids, got_lp), (want_ids, want_lp) in zip(got, want, strict=True):
        assert got_ids == want_ids
        for g, w in zip(got_lp or [], want_lp or [], strict=True):
            assert g.keys() == w.keys()
            assert [g[t].logprob for t in g] == pytest.approx([w[t].logprob for t in w], abs=1e-3)


def build(path, eager: bool, **kwargs) -> LLM:
    kwargs = dict(device="cuda", dtype="float32", num_kv_blocks=64, max_num_seqs=4, max_model_len=96) | kwargs
    return LLM(str(path), enforce_eager=eager, **kwargs)


def graphed_equals_eager(path, emu, **kwargs) -> None:
    want = generate(build(path, eager=True, **kwargs))
    llm = build(path, eager=False, **kwargs)
    graphs = llm.llm_engine.model_runner.decode_graphs
    assert graphs is not None and sorted(graphs.graphs) == graphs.sizes == [1, 2, 4]
    replays = emu.replays
    got = generate(llm)
    assert emu.replays - replays == 4  # every decode step ran from a graph
    assert_same(got, want)
