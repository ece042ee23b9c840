"""Padded rows (`padded_tokens`): while a runner pads rows, the linears see only `row_buckets` row counts however
varied the steps (oneDNN keeps a kernel per row count it meets), and the outputs, logprobs and KV cache equal an
unpadded run's."""

import dataclasses

import numpy as np
import pytest
import torch

from tiffin import LLM, LoRARequest, SamplingParams
from tiffin.engine.models.config import cpu_gemm_native
from tiffin.engine.worker.warm_up import distinct_linears
from tiffin.kernels.row_buckets import padded_tokens, row_buckets
from tiffin.quant.base import UnquantizedLinearMethod

N = 72  # sequences: decode batches from 72 down to 1, one finishing a step, past the 64 rows bf16 prefills stopped at
MAX_TOKENS = 96  # a step's budget: prefill chunks beside decodes, every size up to it


def test_padded_tokens():
    cases = {1: 1, 8: 8, 9: 10, 16: 16, 17: 20, 64: 64, 65: 80, 128: 128, 129: 160, 300: 320, 4096: 4096}
    assert {n: padded_tokens(n) for n in cases} == cases
    padded = [padded_tokens(n) for n in range(1, 4097)]
    assert all(n <= p <= n * 5 / 4 and padded_tokens(p) == p for n, p in enumerate(padded, 1))
    assert row_buckets(4096) == sorted(set(padded))
    assert len(row_buckets(4096)) == 7 + 4 * 9 + 1  # 1 to 7, 4 sizes in each power of two from 8, 4,096


def test_warm_up_builds_every_size_a_step_can_reach(tiny_model, monkeypatch):
    """At start, each distinct linear runs at the padded size of every step the scheduler may make (1 to
    max_num_batched_tokens tokens, past the 1,024 rows warm-up once stopped at) and the head at that of every
    sampling pass (1 to max_num_seqs rows), at each thread count the runner may pick: serving then builds no oneDNN
    kernel (issue #50's soak grew ~0.6 MiB per size and shape warm-up had left to first use)."""
    monkeypatch.setenv("TIFFIN_CPU_FP32_GEMM", "onednn")
    seen, apply = set(), UnquantizedLinearMethod.apply

    def record(method, layer, x):
        seen.add((torch.get_num_threads(), id(layer), x.reshape(-1, x.shape[-1]).shape[0]))
        return apply(method, layer, x)

    monkeypatch.setattr(UnquantizedLinearMethod, "apply", record)
    tokens, seqs = 2048, 24
    runner = LLM(tiny_model("llama"), max_num_seqs=seqs, max_num_batched_tokens=tokens).llm_engine.model_runner
    assert runner.policy.pad_rows
    model = runner.model
    threads = runner.thread_sizer.counts() if runner.thread_sizer else [torch.get_num_threads()]
    head = model.model.embed_tokens if model.lm_head is None else model.lm_head
    sizes = [(layer, tokens) for layer in distinct_linears(model)] + [(head, seqs)]
    want = {(t, id(layer), padded_tokens(n)) for t in threads for layer, most in sizes for n in range(1, most + 1)}
    assert want <= seen, sorted((t, n) for t, _, n in want - seen)


def _workload():
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 200, int(n)).tolist()} for n in rng.integers(1, 40, N)]
    params = [SamplingParams(temperature=0, max_tokens=2 + i, logprobs=2, ignore_eos=True) for i in range(N)]
    return prompts, params


def _run(path, monkeypatch, pad: bool, dtype="float32", lora=None):
    """The workload's outputs, the row counts the linears saw, the steps' real token counts and the KV cache."""
    monkeypatch.setenv("TIFFIN_CPU_FP32_GEMM", "onednn")  # the fp32 path that keeps a kernel per row count
    args = dict(num_kv_blocks=160, max_num_seqs=N, max_num_batched_tokens=MAX_TOKENS, enable_prefix_caching=False)
    llm = LLM(path, dtype=dtype, **args, **(lora or {}).get("engine", {}))
    runner = llm.llm_engine.model_runner
    # no bf16 GEMM in oneDNN (AVX2 only): torch's fallback keeps nothing per row count, so nothing pads; forced here
    assert runner.policy.pad_rows == cpu_gemm_native(runner.model_config.dtype)
    runner.policy = dataclasses.replace(runner.policy, pad_rows=pad)
    seen, steps, apply, host_batch = set(), set(), UnquantizedLinearMethod.apply, runner.host_batch

    def record(method, layer, x):
        seen.add(x.reshape(-1, x.shape[-1]).shape[0])
        return apply(method, layer, x)

    def record_step(scheduler_output):
        steps.add(sum(scheduler_output.num_scheduled_tokens))
        return host_batch(scheduler_output)

    monkeypatch.setattr(UnquantizedLinearMethod, "apply", record)
    monkeypatch.setattr(runner, "host_batch", record_step)
    prompts, params = _workload()
    requests = None if lora is None else lora["requests"]
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=requests)
    monkeypatch.undo()
    return [c for o in outs for c in o.outputs], seen, steps, runner.kv_cache.clone()


def _assert_same(got, want, exact: bool):
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        for g_lp, w_lp in zip(g.logprobs, w.logprobs, strict=True):
            approx = {t: pytest.approx(lp.logprob, abs=0 if exact else 1e-5) for t, lp in w_lp.items()}
            assert {t: lp.logprob for t, lp in g_lp.items()} == approx


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_linears_see_only_bucket_rows_and_outputs_match(tiny_model, monkeypatch, dtype):
    path = tiny_model("llama")
    want, unpadded, steps, want_kv = _run(path, monkeypatch, pad=False, dtype=dtype)
    got, padded, padded_steps, got_kv = _run(path, monkeypatch, pad=True, dtype=dtype)
    assert padded_steps == steps and len(steps) >= 60 and max(steps) == MAX_TOKENS  # a varied load, alike
    buckets = set(row_buckets(MAX_TOKENS))
    assert not unpadded <= buckets  # unpadded, the linears meet row counts outside the set
    assert padded <= buckets, sorted(padded - buckets)
    _assert_same(got, want, exact=dtype == "bfloat16")
    assert torch.equal(got_kv, want_kv)  # padding rows wrote no slot


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lora_steps_pad_on_the_base_model(tiny_model, tmp_path, monkeypatch, dtype):
    """Padding rows run on the base model; the adapters' own GEMMs: test_kernels_lora.py."""
    from lora_adapters import ADAPTERS, make_adapter

    path = tiny_model("llama")
    dirs = [make_adapter(path, tmp_path / name, seed=i, **ADAPTERS[name]) for i, name in enumerate(ADAPTERS)]
    loras = [LoRARequest(d.name, i + 1, str(d)) for i, d in enumerate(dirs[:2])]
    lora = {
        "engine": dict(enable_lora=True, max_loras=2, max_lora_rank=16),
        "requests": [None if i % 3 == 2 else loras[i % 3] for i in range(N)],  # two adapters and the base model
    }
    want, _, steps, want_kv = _run(path, monkeypatch, pad=False, dtype=dtype, lora=lora)
    got, padded, _, got_kv = _run(path, monkeypatch, pad=True, dtype=dtype, lora=lora)
    assert len(steps) >= 60 and padded <= set(row_buckets(MAX_TOKENS)), sorted(padded)
    _assert_same(got, want, exact=dtype == "bfloat16")
    assert torch.equal(got_kv, want_kv)
