"""Greedy outputs token-identical to transformers `generate`, one prompt at a time, eos disabled."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tiffin import LLM, SamplingParams

PROMPT_LENS = [1, 3, 9, 17, 31, 48, 64, 90, 100, 130, 151, 199, 250, 301, 320, 7]
NEW_TOKENS = 40


def reference(path, prompts):
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    out = []
    for p in prompts:  # an explicit mask: without one, generate masks every prompt token equal to pad_token_id
        ids = torch.tensor([p])
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
        out.append(gen[0, len(p) :].tolist())
    return out


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2", "qwen3"])
def case(request, tiny_model):
    path = tiny_model(request.param)
    vocab = AutoModelForCausalLM.from_pretrained(path).config.vocab_size
    g = torch.Generator().manual_seed(len(request.param))
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
    return path, prompts, reference(path, prompts)


@pytest.mark.parametrize(
    "engine_args",
    [{}, {"num_kv_blocks": 30}, {"max_num_batched_tokens": 37}],
    ids=["plain", "preemption", "chunked-prefill"],
)
def test_greedy_matches_transformers(case, engine_args):
    path, prompts, expected = case
    llm = LLM(path, dtype="float32", **engine_args)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    mismatched = [len(p) for p, a, b in zip(prompts, got, expected) if a != b]
    assert not mismatched, f"prompt lengths whose tokens differ: {mismatched}"
    stats = llm.llm_engine.stats()
    assert stats.kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0
    if "num_kv_blocks" in engine_args:
        assert stats.num_preemptions > 0


@pytest.mark.parametrize("fp32_gemm", ["mkl", "onednn"])
def test_greedy_matches_transformers_with_either_cpu_gemm(case, fp32_gemm, monkeypatch):
    """fp32 linears run on MKL or oneDNN, whichever this CPU runs faster: both must match."""
    monkeypatch.setenv("TIFFIN_CPU_FP32_GEMM", fp32_gemm)
    test_greedy_matches_transformers(case, {})
