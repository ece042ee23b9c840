"""Mixtures of experts decoded from CUDA graphs under the CUDA emulation (Triton kernels interpreted): the stacked
experts run `kernels.fused_moe`, whose sort by expert stays on the device, and DeepSeek's decode rows the Triton
latent decode, which reads the contexts' lengths on the device, so decode steps are captured and replayed
(models/moe.py, models/deepseek.py, worker/graphed_decode.py).

- Qwen3-MoE, Mixtral, DeepSeek-V2 and -V3 (test_deepseek's configs: grouped top-k, shared experts, YaRN, q_lora)
  on tiny random fp32 checkpoints written by transformers: greedy tokens and logprobs of decode steps replayed from
  graphs equal transformers' (1e-4), and (Qwen3-MoE, DeepSeek-V3) the same engine's run eagerly.
- (slow) Qwen2-MoE (a gated shared expert, a dense layer) at TP=2: both ranks replay their graphs, all-reduces
  inside, and equal transformers; warm-up launched every Triton variant serving does.
- A host read in the graphed path fails the capture: with the experts' torch path (one read of the counts a
  layer) in place of the Triton one, building the engine raises.
- What still reads the host each step keeps its decode eager, refused by name: GGUF experts (one expert at a time)
  and an fp32 latent wider than the Triton decode takes.
"""

import dataclasses
import json

import pytest
import test_deepseek
import torch
from references import reference_generate
from test_moe import ARCHS, TINY, VOCAB, prompts, randomize
from transformers import AutoConfig, AutoModelForCausalLM

from tiffin import LLM, SamplingParams
from tiffin.engine.models.loader import get_model_config
from tiffin.engine.worker import graphed_decode, model_runner
from tiffin.kernels import dispatch
from tiffin.kernels import triton_common as tc
from tiffin.kernels.fused_moe import fused_moe_torch
from tiffin.quant.gguf import GGUFConfig
from tiffin.testing.cuda_emulation import EmulatedCudaError
from tiffin.tiny import write_tokenizer

# model_type -> its config (transformers' keywords)
CONFIGS = {t: TINY | extra for t, extra in ARCHS.items()}
CONFIGS |= {t: test_deepseek.TINY | extra for t, extra in test_deepseek.ARCHS.items()}
EAGER_TOO = ("qwen3_moe", "deepseek_v3")  # eager runs the same kernels: two architectures show it (each costs seconds)
MAX_TOKENS = (5, 3)  # the batch decodes 2 rows, then 1 (padded to 2)
ENGINE = dict(device="cuda", dtype="float32", max_num_seqs=2, max_model_len=64, num_kv_blocks=8)


def batch() -> list[list[int]]:
    return prompts()[:2]  # 1 and 7 tokens: one short prefill step, as a prefill costs by the token here


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """model_type -> (checkpoint path, transformers' greedy (tokens, logprobs) for `batch()`)."""
    out = {}
    for model_type, config in CONFIGS.items():
        path = tmp_path_factory.mktemp(model_type)
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config), dtype=torch.float32)
        randomize(hf.eval())
        g = torch.Generator().manual_seed(1)
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's, a buffer: `randomize` leaves it zero
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=g))
        hf.save_pretrained(path)
        write_tokenizer(path, VOCAB, model_type.startswith("qwen"), TINY["max_position_embeddings"])
        hf.generation_config.eos_token_id = None
        out[model_type] = path, [reference_generate(hf, p, n) for p, n in zip(batch(), MAX_TOKENS)]
    return out


@pytest.fixture
def no_warm_up(monkeypatch):
    """No warm-up, one graph (of 2 rows: the batch's last steps pad 1 row to it); each forward costs seconds."""
    monkeypatch.setattr(model_runner, "warm_up_triton", lambda runner: None)
    monkeypatch.setattr(graphed_decode, "decode_batch_sizes", lambda rows, quantized: [2])


def generate(llm: LLM) -> list[tuple[list[int], list[float]]]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0) for n in MAX_TOKENS]
    outs = llm.generate([{"prompt_token_ids": p} for p in batch()], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [s[t].logprob for s, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]  # fmt: skip


def assert_matches(got, expected) -> None:
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, expected, strict=True):
        assert tokens == want_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < 1e-4


@pytest.mark.parametrize("model_type", [t for t in CONFIGS if t != "qwen2_moe"])  # Qwen2-MoE's: at TP=2 below
def test_graphed_decode_equals_eager_and_transformers(checkpoints, model_type, cuda_emulation, no_warm_up):
    path, expected = checkpoints[model_type]
    llm = LLM(str(path), **ENGINE)
    assert sorted(llm.llm_engine.model_runner.decode_graphs.graphs) == [2]
    replays = cuda_emulation.replays
    graphed = generate(llm)
    assert cuda_emulation.replays - replays == max(MAX_TOKENS) - 1  # every decode step from a graph
    graph_kernels = {
        k for graph, _ in llm.llm_engine.model_runner.decode_graphs.graphs.values() for k in graph.kernels()
    }
    assert "_moe_gemm_kernel" in graph_kernels
    assert ("_mla_decode_kernel" in graph_kernels) == model_type.startswith("deepseek")
    assert_matches(graphed, expected)
    if model_type in EAGER_TOO:
        assert_matches(generate(LLM(str(path), enforce_eager=True, **ENGINE)), graphed)


def test_a_host_read_in_the_experts_fails_the_capture(checkpoints, cuda_emulation, no_warm_up, monkeypatch):
    """The torch experts (`run_experts`: the experts' counts read on the host) in the Triton one's place."""
    monkeypatch.setitem(dispatch._IMPLEMENTATIONS, ("fused_moe", "triton"), fused_moe_torch)
    with pytest.raises(EmulatedCudaError, match="inside a CUDA graph capture"):
        LLM(str(checkpoints["qwen3_moe"][0]), **ENGINE)


def test_what_reads_the_host_each_step_is_refused_by_name(checkpoints, tmp_path):
    config = get_model_config(checkpoints["qwen3_moe"][0])
    assert graphed_decode.graph_refusal(config) is None
    gguf = dataclasses.replace(config, quant_config=GGUFConfig(kept={}))  # a GGUF file's: a layer per expert
    assert graphed_decode.graph_refusal(gguf).startswith("Qwen3MoeForCausalLM: GGUF experts run one expert at a time")
    path = checkpoints["deepseek_v3"][0]
    config = get_model_config(path)
    assert graphed_decode.graph_refusal(config) is None  # fp32, rank 32
    assert graphed_decode.graph_refusal(dataclasses.replace(config, quant_config=GGUFConfig(kept={}))) is None
    raw = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw | dict(kv_lora_rank=512, qk_rope_head_dim=64)))
    wide = get_model_config(tmp_path)
    refusal = "DeepseekV3ForCausalLM: a float32 latent of rank 512 > 128 decodes by the torch plan"
    assert graphed_decode.graph_refusal(wide).startswith(refusal)
    assert graphed_decode.graph_refusal(dataclasses.replace(wide, dtype=torch.bfloat16)) is None


@pytest.mark.slow
@pytest.mark.subprocess
def test_tensor_parallel_graphed_decode_equals_transformers(checkpoints, cuda_emulation):
    """TP=2 (rank 1 a worker process under an emulation of its own, NCCL's all-reduces run by gloo): each rank's
    half of every expert in its graphs, the experts' and the shared expert's sums all-reduced inside; rank 1 replays
    every graph rank 0 does; serving launches no Triton variant that start-up (warm-up) did not."""
    path, expected = checkpoints["qwen2_moe"]
    with tc.recording_launches() as started:
        llm = LLM(str(path), tensor_parallel_size=2, distributed_timeout=120, **ENGINE)
    try:
        assert sorted(llm.llm_engine.model_runner.decode_graphs.graphs) == [1, 2]
        with tc.recording_launches() as served:
            got = generate(llm)
        replays = cuda_emulation.replays
    finally:
        llm.shutdown()
    assert_matches(got, expected)
    assert replays >= max(MAX_TOKENS) - 1 and cuda_emulation.worker_replays() == {1: replays}
    assert any(variant[0].endswith("_moe_gemm_kernel") for variant in served)
    assert not served - started, sorted(served - started, key=str)[:2]
