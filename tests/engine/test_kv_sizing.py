"""KV cache sizing on CUDA, checked with no GPU: the arithmetic on injected readings, and the profiling step run
on CPU through a fake memory probe that records what was live when each reading was taken."""

import pytest

from tiffin import LLM
from tiffin.engine.worker.kv_cache import GiB, MemoryProbe, MemoryProfile, profile_memory
from tiffin.engine.worker.sampler import Sampler

BLOCK = 2 << 20  # bytes per KV block


def test_pool_gets_what_utilization_leaves():
    profile = MemoryProfile(total=24 * GiB, free=20 * GiB, peak=1 * GiB)
    # 0.9 * 24 GiB = 21.6 GiB, less 4 GiB in use and 1 GiB of activations: 16.6 GiB
    want = (int(24 * GiB * 0.9) - 4 * GiB - 1 * GiB) // BLOCK
    assert profile.kv_blocks(0.9, BLOCK, max_blocks_per_seq=8) == want == 8499
    with_graphs = MemoryProfile(total=24 * GiB, free=20 * GiB, peak=1 * GiB, graphs=GiB // 2)  # held for good
    assert with_graphs.kv_blocks(0.9, BLOCK, max_blocks_per_seq=8) == want - (GiB // 2) // BLOCK


def test_a_sequence_that_cannot_fit_is_refused_with_the_numbers():
    profile = MemoryProfile(total=24 * GiB, free=8 * GiB, peak=2 * GiB)  # 21.6 - 16 - 2 = 3.6 GiB left
    assert profile.kv_blocks(0.9, BLOCK, max_blocks_per_seq=1843) == 1843
    with pytest.raises(ValueError) as err:
        profile.kv_blocks(0.9, BLOCK, max_blocks_per_seq=1844)
    for fact in ("1844 KV blocks", "3.60 GiB) for one sequence", "0.9", "24.00 GiB", "16.00 GiB in use", "2.00 GiB"):
        assert fact in str(err.value)
    with pytest.raises(ValueError, match="leaves -1.00 GiB"):
        MemoryProfile(total=10 * GiB, free=2 * GiB, peak=2 * GiB).kv_blocks(0.9, BLOCK, 1)


class FakeProbe:
    """Plays a device: `allocated` follows the runner's KV cache, and reading free memory checks that the
    profiling cache is gone by then."""

    def __init__(self, runner):
        self.runner, self.calls, self.peak_reset = runner, [], False

    def memory(self) -> MemoryProbe:
        def allocated(device):
            self.calls.append(("allocated", self.runner.num_blocks, hasattr(self.runner, "kv_cache")))
            return 1000

        def mem_get_info(device):
            self.calls.append(("free", hasattr(self.runner, "kv_cache")))
            return 6 * GiB, 8 * GiB

        return MemoryProbe(
            mem_get_info=mem_get_info,
            memory_reserved=allocated,
            max_memory_reserved=lambda device: 1000 + 300 * (1 << 20),
            reset_peak_memory_stats=lambda device: self.calls.append(("reset",)),
            synchronize=lambda device: None,
            empty_cache=lambda: None,
        )


def test_profiling_uses_only_the_blocks_it_needs_and_frees_them(tiny_model, monkeypatch):
    llm = LLM(tiny_model("llama"), num_kv_blocks=64, max_model_len=100, max_num_batched_tokens=250, max_num_seqs=5)
    runner = llm.llm_engine.model_runner
    seen = {}
    host_batch, sample = runner.host_batch, Sampler.__call__

    def record_batch(sched):
        seen["lengths"] = sched.num_scheduled_tokens
        seen["tables"] = [s.block_table for s in sched.seqs]
        return host_batch(sched)

    def record_sample(sampler, logits, seqs, bitmask=None, inputs=None):
        seen["logits"], seen["engine's"] = tuple(logits.shape), sampler is runner.sampler
        return sample(sampler, logits, seqs, bitmask, inputs)

    compute_logits = runner.model.compute_logits
    monkeypatch.setattr(
        runner.model, "compute_logits", lambda h: seen.setdefault("lm_head", []).append(h.shape[0]) or compute_logits(h)
    )
    monkeypatch.setattr(runner, "host_batch", record_batch)
    monkeypatch.setattr(Sampler, "__call__", record_sample)
    probe = FakeProbe(runner)
    profile = profile_memory(runner, probe.memory())
    # 250 tokens as sequences of at most max_model_len (100 -> 7 blocks of 16), blocks disjoint
    assert seen["lengths"] == [100, 100, 50]
    assert seen["tables"] == [list(range(7)), list(range(7, 14)), [14, 15, 16, 17]]
    assert seen["logits"] == (5, runner.model_config.vocab_size)
    # a sampler of its own: the engine's seeded stream (unseeded rows' draws) starts where a pool given its size would
    assert not seen["engine's"]
    # the lm_head runs on every sequence's row, as a decode step of max_num_seqs does (from DENSE_MIN_TOKENS rows a
    # quantized one dequantizes its whole weight): the step's 3 sampled rows, then max_num_seqs
    assert seen["lm_head"] == [3, 5]
    assert probe.calls == [("allocated", 18, True), ("reset",), ("free", False)]
    assert profile == MemoryProfile(total=8 * GiB, free=6 * GiB, peak=300 * (1 << 20))
    assert all(attn.k_cache.numel() == 0 for attn in runner.model.layers_kv())
    del llm
