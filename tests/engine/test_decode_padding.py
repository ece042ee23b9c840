"""Padded steps must equal unpadded ones. Decode steps (the CUDA-graph path) run on CPU through the same buffers
and padding, eagerly; the graphs themselves need a GPU, everything they read is checked here. Prefill steps on CPU
at bf16 pad to `padded_tokens`."""

import dataclasses

import numpy as np
import pytest
import torch

from tiffin import LLM, SamplingParams
from tiffin.engine.worker.batch import padded_tokens
from tiffin.engine.worker.cuda_graphs import decode_batch_sizes

PROMPTS = ["Hello, tiffin", "The quick brown fox jumps", "1 2 3", "a", "Once upon a time in a land far away"]


def test_decode_batch_sizes():
    assert decode_batch_sizes(1) == [1]
    assert decode_batch_sizes(3) == [1, 2, 4]
    assert decode_batch_sizes(8) == [1, 2, 4, 8]
    assert decode_batch_sizes(20) == [1, 2, 4, 8, 16, 24]
    sizes = decode_batch_sizes(4096)  # capped like vLLM
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 512 and len(sizes) == 3 + 512 // 8
    # a quantized model's graphs stop where its GEMMs turn to dequantize-then-matmul
    assert decode_batch_sizes(4096, quantized=True)[-1] == decode_batch_sizes(255)[-2] == 248
    assert decode_batch_sizes(20, quantized=True) == decode_batch_sizes(20)


def _generate(llm: LLM):
    greedy = SamplingParams(temperature=0, max_tokens=10, logprobs=2)
    seeded = [SamplingParams(temperature=0.9, top_p=0.9, max_tokens=6 + i, seed=i) for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, greedy, use_tqdm=False) + llm.generate(PROMPTS, seeded, use_tqdm=False)
    return [(c.token_ids, c.logprobs) for o in outs for c in o.outputs]


def test_padded_decode_equals_unpadded(tiny_model, monkeypatch):
    path = tiny_model("llama")
    want = _generate(LLM(path, num_kv_blocks=64, max_num_seqs=16))
    llm = LLM(path, num_kv_blocks=64, max_num_seqs=16)
    runner = llm.llm_engine.model_runner
    assert runner.decode_graphs is None  # CPU default: unpadded
    runner.pad_decodes(decode_batch_sizes(16))
    graphs = runner.decode_graphs
    assert not graphs.graphs
    sizes, padded = [], graphs.padded

    def record(size, batch, *args):
        sizes.append((size, len(batch.seq_lens)))
        # the step's attention grid must not depend on its contexts: max_seq_len is max_model_len's
        assert graphs.metadata(size, [1] * size).max_seq_len == runner.max_blocks_per_seq * runner.block_size
        return padded(size, batch, *args)

    monkeypatch.setattr(graphs, "padded", record)
    got = _generate(llm)
    assert (8, 5) in sizes and any(n < size for size, n in sizes)  # padded steps ran, with padding rows
    for (want_ids, want_lp), (got_ids, got_lp) in zip(want, got, strict=True):
        assert got_ids == want_ids
        if want_lp is not None:
            for w, g in zip(want_lp, got_lp, strict=True):
                assert w.keys() == g.keys()
                for t in w:
                    assert g[t].logprob == pytest.approx(w[t].logprob, abs=1e-4)
    # padding rows wrote only the dummy block past the pool, never a block the block manager hands out
    assert runner.kv_cache.shape[2] == llm.llm_engine.block_manager.num_blocks + 1 == 65


def test_padded_tokens():
    cases = {1: 1, 64: 64, 65: 72, 72: 72, 73: 80, 128: 128, 129: 144, 300: 320, 4096: 4096}
    assert {n: padded_tokens(n) for n in cases} == cases
    padded = [padded_tokens(n) for n in range(1, 4097)]
    assert all(n <= p <= n * 9 / 8 and padded_tokens(p) == p for n, p in enumerate(padded, 1))
    assert len(set(padded)) == 64 + 8 * 6  # exact up to 64, then 8 sizes per power of two


def test_padded_prefill_equals_unpadded(tiny_model, monkeypatch):
    path = tiny_model("llama")
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 200, n).tolist()} for n in (70, 100, 133, 5)]
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=2)

    def run(pad: bool):
        llm = LLM(path, dtype="bfloat16", num_kv_blocks=64, max_num_seqs=4, enable_prefix_caching=False)
        runner = llm.llm_engine.model_runner
        assert runner.policy.pad_prefills == torch.cpu._is_amx_tile_supported()  # AMX: oneDNN's kernel builds
        runner.policy = dataclasses.replace(runner.policy, pad_prefills=pad)
        rows, host_batch = [], runner.host_batch
        monkeypatch.setattr(runner, "host_batch", lambda s: rows.append(host_batch(s)) or rows[-1])
        outs = [c for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]
        return outs, [(len(b.input_ids), b.query_start_loc[-1]) for b in rows], runner.kv_cache

    want, want_rows, want_kv = run(pad=False)
    got, got_rows, got_kv = run(pad=True)
    assert all(n == real for n, real in want_rows)
    assert (padded_tokens(308), 308) in got_rows  # the first step: all four prompts
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids
        for w_lp, g_lp in zip(w.logprobs, g.logprobs, strict=True):
            assert {t: lp.logprob for t, lp in g_lp.items()} == pytest.approx({t: lp.logprob for t, lp in w_lp.items()})
    assert torch.equal(got_kv, want_kv)  # padding rows wrote no slot
