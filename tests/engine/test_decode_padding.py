"""Padded decode steps must equal unpadded ones. Decode steps (the CUDA-graph path) run on CPU through the same
buffers and padding, eagerly; the graphs themselves need a GPU, everything they read is checked here. (Steps padded
to `padded_tokens` on CPU: test_row_buckets.py.)"""

import pytest

from tiffin import LLM, SamplingParams
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
