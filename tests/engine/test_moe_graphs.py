"""Mixtures of experts decoded from CUDA graphs under the CUDA emulation (Triton kernels interpreted): the stacked
experts run `kernels.fused_moe`, whose sort by expert stays on the device, so decode steps are captured and
replayed (models/moe.py, worker/graphed_decode.py).

- Qwen3-MoE, Mixtral and Qwen2-MoE (a gated shared expert, a dense layer) on tiny random fp32 checkpoints written
  by transformers (test_moe's): greedy tokens and logprobs of decode steps replayed from graphs equal transformers'
  (1e-4), and (Qwen3-MoE) the same engine's run eagerly.
- A host read in the graphed path fails the capture: with the experts' torch path (one read of the counts a
  layer) in place of the Triton one, building the engine raises.
- What still reads the host each step keeps its decode eager, refused by name: GGUF experts (one expert at a time)
  and DeepSeek's latent attention (its decode plan).
"""

import dataclasses

import pytest
import torch
from references import reference_generate
from test_moe import ARCHS, TINY, VOCAB, prompts, randomize
from transformers import AutoConfig, AutoModelForCausalLM

from tiffin import LLM, SamplingParams
from tiffin.engine.models.loader import get_model_config
from tiffin.engine.worker import graphed_decode, model_runner
from tiffin.kernels import dispatch
from tiffin.kernels.fused_moe import fused_moe_torch
from tiffin.quant.gguf import GGUFConfig
from tiffin.testing.cuda_emulation import EmulatedCudaError
from tiffin.tiny import write_tokenizer

MAX_TOKENS = (5, 3)  # the batch decodes 2 rows, then 1: both graph sizes replayed
ENGINE = dict(device="cuda", dtype="float32", max_num_seqs=2, max_model_len=64, num_kv_blocks=8)


def batch() -> list[list[int]]:
    return prompts()[:2]  # 1 and 7 tokens: one short prefill step, as a prefill costs by the token here


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """model_type -> (checkpoint path, transformers' greedy (tokens, logprobs) for `batch()`)."""
    out = {}
    for model_type, extra in ARCHS.items():
        path = tmp_path_factory.mktemp(model_type)
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **TINY, **extra), dtype=torch.float32)
        randomize(hf.eval())
        hf.save_pretrained(path)
        write_tokenizer(path, VOCAB, model_type.startswith("qwen"), TINY["max_position_embeddings"])
        hf.generation_config.eos_token_id = None
        out[model_type] = path, [reference_generate(hf, p, n) for p, n in zip(batch(), MAX_TOKENS)]
    return out


@pytest.fixture
def no_warm_up(monkeypatch):
    monkeypatch.setattr(model_runner, "warm_up_triton", lambda runner: None)


def generate(llm: LLM) -> list[tuple[list[int], list[float]]]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0) for n in MAX_TOKENS]
    outs = llm.generate([{"prompt_token_ids": p} for p in batch()], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [s[t].logprob for s, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]  # fmt: skip


def assert_matches(got, expected) -> None:
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, expected, strict=True):
        assert tokens == want_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < 1e-4


@pytest.mark.parametrize("model_type", list(ARCHS))
def test_graphed_decode_equals_eager_and_transformers(checkpoints, model_type, cuda_emulation, no_warm_up):
    path, expected = checkpoints[model_type]
    llm = LLM(str(path), **ENGINE)
    assert sorted(llm.llm_engine.model_runner.decode_graphs.graphs) == [1, 2]
    replays = cuda_emulation.replays
    graphed = generate(llm)
    assert cuda_emulation.replays - replays == max(MAX_TOKENS) - 1  # every decode step from a graph
    assert "_moe_gemm_kernel" in cuda_emulation.launches
    assert_matches(graphed, expected)
    if model_type == "qwen3_moe":  # eager runs the same kernels: one architecture shows it (each costs seconds)
        assert_matches(generate(LLM(str(path), enforce_eager=True, **ENGINE)), graphed)


def test_a_host_read_in_the_experts_fails_the_capture(checkpoints, cuda_emulation, no_warm_up, monkeypatch):
    """The torch experts (`run_experts`: the experts' counts read on the host) in the Triton one's place."""
    monkeypatch.setitem(dispatch._IMPLEMENTATIONS, ("fused_moe", "triton"), fused_moe_torch)
    with pytest.raises(EmulatedCudaError, match="inside a CUDA graph capture"):
        LLM(str(checkpoints["qwen3_moe"][0]), **ENGINE)


def test_what_reads_the_host_each_step_is_refused_by_name(checkpoints, tmp_path):
    config = get_model_config(checkpoints["qwen3_moe"][0])
    assert graphed_decode.graph_refusal(config) is None
    gguf = dataclasses.replace(config, quant_config=GGUFConfig(kept={}))
    assert "Qwen3MoeForCausalLM: GGUF experts run one expert at a time" in graphed_decode.graph_refusal(gguf)
    deepseek = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8)
    config = AutoConfig.for_model("deepseek_v2", architectures=["DeepseekV2ForCausalLM"], **TINY, **deepseek)
    config.save_pretrained(tmp_path)
    refusal = graphed_decode.graph_refusal(get_model_config(tmp_path))
    assert refusal.startswith("DeepseekV2ForCausalLM: the latent attention's decode plan")
