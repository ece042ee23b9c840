"""DeepSeek-V2 / V3 (models/deepseek.py) on tiny random fp32 checkpoints written by transformers itself.

V2: one q_proj (V2-Lite's shape), softmax routing limited to 1 of 4 expert groups (`group_limited_greedy`), two
shared experts, routed_scaling_factor, YaRN rope scaling with mscale_all_dim (the softmax scale and the rotary
attention factor both differ from 1). V3: q_a/q_b projections, sigmoid routing with a random
e_score_correction_bias over 2 of 4 groups (`noaux_tc`), norm_topk_prob, one shared expert. Both: the first layer
dense (first_k_dense_replace). Greedy 48 tokens and their logprobs equal transformers' (1e-4), with prefix-cache
hits, chunked prefill and, on a pool too small for the batch, preemption (recompute, or swap with the host tier),
with speculative proposals verified, and on the CUDA path under the emulation; at TP=2 (worker processes, and on
the CUDA path under the emulation) with prompt logprobs too, each rank's shards summing to the whole layer and its
KV cache holding the whole latent vector a token; attention over the latent cache
(fresh prefill, a chunk over a cached prefix, decode rows) equals a float64 MLA written here from the checkpoint's
tensors; the KV cache holds (kv_lora_rank + qk_rope_head_dim) x layers x dtype bytes per token; what is not served
is refused by name."""

import json

import pytest
import torch
from references import reference_generate
from safetensors.torch import load_file
from test_moe import randomize
from test_prompt_logprobs import assert_prompt_logprobs
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from tiffin import LLM, SamplingParams
from tiffin.engine.distributed.tensor_parallel import TensorParallel
from tiffin.engine.models.deepseek import DeepseekConfig, DeepseekMoE
from tiffin.engine.models.loader import build_model, get_model_config
from tiffin.engine.models.moe import grouped_topk
from tiffin.engine.worker import model_runner
from tiffin.engine.worker.kv_cache import KVCacheSpec
from tiffin.kernels import attention
from tiffin.kernels.attention import AttentionMetadata
from tiffin.tiny import write_tokenizer

VOCAB, NEW_TOKENS = 512, 48
TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    num_experts_per_tok=2,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    moe_intermediate_size=24,
    first_k_dense_replace=1,
    n_group=4,
    topk_group=2,
)
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=0.8)
ARCHS = {
    "deepseek_v2": dict(
        q_lora_rank=None,
        n_shared_experts=2,
        topk_method="group_limited_greedy",
        topk_group=1,  # of 4 groups of 2 experts, for its top 2: the group limit then changes choices
        routed_scaling_factor=1.5,
        rope_parameters={**YARN, "rope_theta": 10000.0},
    ),
    "deepseek_v3": dict(q_lora_rank=48, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True),
}
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    p = [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in (1, 7, 21, 40)]
    return p + [p[3][:32] + p[1]]  # shares two 16-token blocks with the 40-token prompt


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """model_type -> (checkpoint path, the transformers model, its greedy tokens and logprobs for `prompts()`)."""
    out = {}
    for model_type, extra in ARCHS.items():
        path = tmp_path_factory.mktemp(model_type)
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **(TINY | extra)), dtype=torch.float32)
        randomize(hf.eval())
        g = torch.Generator().manual_seed(1)
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a buffer: `randomize` leaves it zero
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=g))
        hf.save_pretrained(path)
        write_tokenizer(path, VOCAB, False, TINY["max_position_embeddings"])
        hf.generation_config.eos_token_id = None
        out[model_type] = path, hf, [reference_generate(hf, p, NEW_TOKENS) for p in prompts()]
    return out


def assert_matches(outs, expected) -> None:
    for prompt, out, (tokens, logprobs) in zip(prompts(), outs, expected):
        got = out.outputs[0]
        assert got.token_ids == tokens, f"prompt of {len(prompt)} tokens"
        got_lp = [step[t].logprob for step, t in zip(got.logprobs, got.token_ids)]
        assert max(abs(a - b) for a, b in zip(got_lp, logprobs)) < 1e-4


@pytest.mark.parametrize("model_type", list(ARCHS))
def test_greedy_batch_matches_transformers(checkpoints, model_type):
    """Prompts chunked (32 tokens a step), the second run's prompts hitting the first's cached blocks."""
    path, _, expected = checkpoints[model_type]
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=32, max_model_len=128)
    for _ in range(2):
        assert_matches(llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY, use_tqdm=False), expected)
    assert llm.llm_engine.stats().prefix_cache_hits > 0
    assert len(set(expected[3][0])) > 8, "greedy decoding loops on a token: the test would prove little"
    runner = llm.llm_engine.model_runner
    layers, blocks = TINY["num_hidden_layers"], runner.num_blocks + 1
    latent = TINY["kv_lora_rank"] + TINY["qk_rope_head_dim"]
    assert runner.kv_cache.shape == (1, layers, blocks, 16, 1, latent)  # one latent vector per token and layer


TIERS = dict(preemption_mode="swap", swap_space=0.01, kv_offload_memory=1 << 20)


@pytest.mark.parametrize("tiers", [{}, TIERS], ids=["recompute", "swap-and-host-tier"])
def test_preempted_sequences_resume_equal(checkpoints, tiers):
    """A 9-block pool for 5 sequences of up to 88 tokens: preempted sequences are recomputed, or swapped out to
    host blocks of the latent cache and back; with the prefix cache's host tier the second run's prompts come back
    from host memory."""
    path, _, expected = checkpoints["deepseek_v3"]
    llm = LLM(
        str(path), dtype="float32", num_kv_blocks=9, max_model_len=128, enable_prefix_caching=bool(tiers), **tiers
    )
    for _ in range(2 if tiers else 1):
        assert_matches(llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY, use_tqdm=False), expected)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    stats = llm.llm_engine.stats()
    assert not tiers or (stats.swapped_out_seqs > 0 and stats.swapped_in_seqs > 0 and stats.host_tier_hits > 0)


class KnownContinuation:
    """Proposes up to 5 tokens of each sequence's greedy continuation (from transformers), every third one wrong:
    verifying rows, several query tokens over a cached prefix, accepted in part."""

    def __init__(self, expected: dict[tuple[int, ...], list[int]]):
        self.expected, self.calls = expected, 0

    def propose(self, seqs) -> None:
        for seq in seqs:
            self.calls += 1
            ahead = self.expected[tuple(seq.prompt_token_ids)][seq.num_output_tokens :][:5]
            seq.spec_token_ids = [t if (i + self.calls) % 3 else (t + 1) % VOCAB for i, t in enumerate(ahead)]


def test_speculative_verification_matches_transformers(checkpoints):
    path, _, expected = checkpoints["deepseek_v2"]
    llm = LLM(str(path), dtype="float32", speculative_config={"method": "ngram", "disable_by_batch_size": None})
    llm.llm_engine.proposer = KnownContinuation({tuple(p): e[0] for p, e in zip(prompts(), expected)})
    assert_matches(llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY, use_tqdm=False), expected)
    stats = llm.llm_engine.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens


@pytest.mark.parametrize("model_type", list(ARCHS))
def test_cuda_path_under_the_emulation_matches_transformers(checkpoints, model_type, cuda_emulation, monkeypatch):
    """The CUDA path on CPU (`cuda_emulation`: the norms, activations, fused experts and latent decode of the
    Triton backend interpreted, the prefills' latent attention torch ops on device tensors), decode steps replayed
    from CUDA graphs (test_moe_graphs)."""
    monkeypatch.setattr(model_runner, "warm_up_triton", lambda runner: None)
    path, _, expected = checkpoints[model_type]
    assert_first_tokens_match(LLM(str(path), device="cuda", **EMULATED), expected)


EMULATED = dict(dtype="float32", max_num_seqs=2, max_model_len=64, num_kv_blocks=8, max_num_batched_tokens=16)


def assert_first_tokens_match(llm: LLM, expected) -> None:
    """`llm`'s first 4 greedy tokens (and logprobs) after prompts 1 and 2 equal transformers' (under the emulation,
    steps cost by their tokens)."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()[1:3]], params, use_tqdm=False)
    for out, (tokens, logprobs) in zip(outs, expected[1:3]):
        got = out.outputs[0]
        assert got.token_ids == tokens[:4]
        got_lp = [step[t].logprob for step, t in zip(got.logprobs, got.token_ids)]
        assert max(abs(a - b) for a, b in zip(got_lp, logprobs)) < 1e-4


@pytest.mark.slow
@pytest.mark.subprocess
def test_tensor_parallel_cuda_path_under_the_emulation_matches_transformers(checkpoints, cuda_emulation):
    """TP=2 on the CUDA path: rank 1 a worker process under an emulation of its own (cuda:1), NCCL's all-reduces run
    by gloo, both ranks warming up their Triton kernels together; decode steps from graphs, as at TP=1."""
    path, _, expected = checkpoints["deepseek_v3"]
    llm = LLM(str(path), device="cuda", tensor_parallel_size=2, distributed_timeout=120, **EMULATED)
    try:
        assert_first_tokens_match(llm, expected)
    finally:
        llm.shutdown()


def test_kv_bytes_per_token_of_a_v2_lite_shape(tmp_path):
    """DeepSeek-V2-Lite's config (no weights): (512 + 64) x 27 layers x 2 bytes (bf16) a token, not per-head K/V;
    at TP=2 on each rank too (the latent cache is whole on every rank, where per-head K/V would halve)."""
    lite = dict(TINY, hidden_size=2048, intermediate_size=10944, num_hidden_layers=27, num_attention_heads=16)
    lite |= dict(kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    lite |= dict(n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, moe_intermediate_size=1408)
    lite |= dict(n_group=1, topk_group=1, architectures=["DeepseekV2ForCausalLM"], torch_dtype="bfloat16")
    (tmp_path / "config.json").write_text(json.dumps(lite))
    config = get_model_config(tmp_path)
    spec = KVCacheSpec.of(config, 16, config.num_kv_heads)
    assert spec.bytes_per_token == (512 + 64) * 27 * 2
    assert spec.bytes_per_block == 16 * (512 + 64) * 27 * 2
    for tp in (TensorParallel(0, 2), TensorParallel(1, 2)):  # as each rank's ModelRunner sizes its pool
        assert KVCacheSpec.of(config, 16, tp.kv_heads(config.num_kv_heads)).bytes_per_token == (512 + 64) * 27 * 2
    with pytest.raises(ValueError, match="latent \\(MLA\\) KV cache is stored in the model's dtype only"):
        KVCacheSpec.of(config, 16, config.num_kv_heads, "int8")


def rms_norm(x, w, eps=1e-6):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w


def reference_mla(w: dict, x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Float64 MLA of one sequence `x [L, hidden]` from checkpoint tensors `w` (one layer's `self_attn.*`), as the
    paper writes it: per-head keys [W_UK c, k_pe] and values W_UV c expanded, interleaved-pair rotary, causal."""
    heads, nope, rope, v_dim, rank = 4, TINY["qk_nope_head_dim"], 8, TINY["v_head_dim"], TINY["kv_lora_rank"]
    q = x @ w["q_a_proj.weight"].T
    q = (rms_norm(q, w["q_a_layernorm.weight"]) @ w["q_b_proj.weight"].T).view(len(x), heads, nope + rope)
    c, k_pe = (x @ w["kv_a_proj_with_mqa.weight"].T).split([rank, rope], -1)
    c = rms_norm(c, w["kv_a_layernorm.weight"])
    angles = torch.arange(len(x), dtype=torch.float64)[:, None] / theta ** (torch.arange(0, rope, 2) / rope)

    def rotate(t):  # t [L, n, rope]: pairs (t0, t1), (t2, t3)... turned by each position's angles
        even, odd = t[..., 0::2], t[..., 1::2]
        cos, sin = angles.cos()[:, None], angles.sin()[:, None]
        return torch.stack([even * cos - odd * sin, odd * cos + even * sin], -1).flatten(-2)

    kv = (c @ w["kv_b_proj.weight"].T).view(len(x), heads, nope + v_dim)
    k = torch.cat([kv[..., :nope], rotate(k_pe[:, None]).expand(-1, heads, -1)], -1)
    q = torch.cat([q[..., :nope], rotate(q[..., nope:])], -1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * (nope + rope) ** -0.5
    scores = scores.masked_fill(torch.ones(len(x), len(x)).triu(1).bool(), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), kv[..., nope:]).flatten(1)
    return o @ w["o_proj.weight"].T


BLOCK = 4  # the attention tests' cache blocks: sequence i's blocks are TABLES[i], scrambled
TABLES = torch.tensor([[5, 0, 7, 2], [3, 6, 1, 1]], dtype=torch.int32)
# two sequences' (sequence, start, end) rows over three steps: both prompts' first 6 tokens (no cached prefix), a
# 5-token chunk of the first over its cached prefix beside a decode row of the second, a decode row of the first
STEPS = ([(0, 0, 6), (1, 0, 6)], [(0, 6, 11), (1, 6, 7)], [(0, 11, 12)])


def sequences() -> list[torch.Tensor]:
    """The hidden states of STEPS' two sequences (12 and 7 tokens)."""
    return [torch.randn(n, TINY["hidden_size"], generator=torch.Generator().manual_seed(n)) for n in (12, 7)]


def attend(attn, rotary, xs: list[torch.Tensor], chunks: list[tuple[int, int, int]]) -> torch.Tensor:
    """`attn`'s output for the rows `chunks` of sequences `xs` (their hidden states), in the cache blocks of TABLES."""
    positions = torch.cat([torch.arange(start, end) for _, start, end in chunks])
    slots = torch.cat([TABLES[i, torch.arange(a, b) // BLOCK].long() * BLOCK + torch.arange(a, b) % BLOCK
                       for i, a, b in chunks])  # fmt: skip
    starts = [0]
    for _, start, end in chunks:
        starts.append(starts[-1] + end - start)
    seq_lens = [end for _, _, end in chunks]
    x = torch.cat([xs[i][start:end] for i, start, end in chunks])
    as_tensors = torch.tensor(starts, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32)
    longest = max(b - a for _, a, b in chunks)
    md = AttentionMetadata(slots, *as_tensors, TABLES, starts, seq_lens, longest, max(seq_lens))
    with torch.inference_mode():
        return attn(x, rotary.at(positions), md, None)


@pytest.mark.parametrize("native", [True, False], ids=["native-decode", "torch-decode"])
def test_attention_over_the_latent_cache_equals_the_reference(checkpoints, native, monkeypatch):
    """Two sequences of 12 and 7 tokens in a 4-token-block latent cache with scrambled block tables, over three
    steps (STEPS): prefill, a chunk over a cached prefix beside a decode row, a decode row. Every row equals
    `reference_mla` (decode rows with the native kernel, and on the torch path with it turned off)."""
    if not native:
        monkeypatch.setattr(attention.cpu_native, "supports_cache", lambda *a: False)
    path = checkpoints["deepseek_v3"][0]
    model = build_model(get_model_config(path), path, "cpu", 256, "torch")
    attn = model.model.layers[1].self_attn
    prefix = "model.layers.1.self_attn."
    w = {k[len(prefix) :]: v.double() for k, v in load_file(path / "model.safetensors").items() if k.startswith(prefix)}
    xs = sequences()
    attn.k_cache = attn.v_cache = torch.zeros(8, BLOCK, 1, attn.head_dim)
    expected = [reference_mla(w, x.double(), get_model_config(path).rope_theta) for x in xs]
    for chunks in STEPS:
        got = attend(attn, model.model.rotary, xs, chunks).double()
        torch.testing.assert_close(got, torch.cat([expected[i][a:b] for i, a, b in chunks]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", list(ARCHS))
def test_tensor_parallel_shards_sum_to_the_whole_layer(checkpoints, model_type, monkeypatch):
    """Ranks 0 and 1 of 2 built in this process (all-reduce left out). Each holds half the heads (q_proj or q_b_proj
    and kv_b_proj by rows, o_proj by columns) and the whole latent projection, writes the whole latent vector of
    every token to its own cache (equal to the unsharded model's) and so spends (32 + 8) x 3 layers x 4 bytes of KV
    a token, as unsharded; half of every expert's, the shared experts' and the dense MLP's intermediate dimension,
    the router whole. Their attention outputs over STEPS (prefill, a chunk over a cached prefix, absorbed decode
    rows) and their MLPs' outputs sum to the whole layer's; an MLP, dense or MoE, all-reduces once."""
    reduced = []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda x, group=None: reduced.append(x.shape))
    path = checkpoints[model_type][0]
    config = get_model_config(path)
    tps = TensorParallel(), TensorParallel(0, 2), TensorParallel(1, 2)
    models = [build_model(config, path, "cpu", 256, "torch", tp) for tp in tps]
    latent = TINY["kv_lora_rank"] + TINY["qk_rope_head_dim"]
    for tp in tps:  # the spec each rank's ModelRunner sizes its pool by
        assert KVCacheSpec.of(config, 16, tp.kv_heads(config.num_kv_heads)).bytes_per_token == latent * 3 * 4
    attns = [m.model.layers[1].self_attn for m in models]
    for attn in attns:
        attn.k_cache = attn.v_cache = torch.zeros(8, BLOCK, 1, latent)
    assert [a.num_heads for a in attns] == [4, 2, 2]
    whole_kv, kv = attns[0].kv_b_proj.weight, attns[2].kv_b_proj.weight
    assert torch.equal(kv, whole_kv[len(whole_kv) // 2 :])  # heads 2 and 3: their rows of W_UK and W_UV
    xs = sequences()
    for chunks in STEPS:
        whole, *ranks = (attend(a, m.model.rotary, xs, chunks) for a, m in zip(attns, models))
        torch.testing.assert_close(ranks[0] + ranks[1], whole, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(a.k_cache, attns[0].k_cache) for a in attns[1:])
    x = torch.cat(xs)
    for layer in range(2):  # the dense MLP, the experts and shared experts
        reduced.clear()
        whole, *ranks = (m.model.layers[layer].mlp(x) for m in models)
        torch.testing.assert_close(ranks[0] + ranks[1], whole, rtol=1e-5, atol=1e-5)
        assert len(reduced) == 2  # one all-reduce a rank (of the experts' and shared experts' sum in a MoE layer)
    half = models[0].model.layers[1].mlp.experts.down_proj.shape[2] // 2
    assert models[2].model.layers[1].mlp.experts.down_proj.shape[2] == half


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("model_type, tiers", [("deepseek_v2", {}), ("deepseek_v3", TIERS)], ids=["v2", "v3-swap"])
def test_tensor_parallel_engine_matches_transformers(checkpoints, model_type, tiers):
    """TP=2 worker processes (gloo on CPU), prompts chunked (32 tokens a step) into a 10-block pool too small for the
    batch (V2: preempted sequences recomputed; V3: swapped out to host blocks and back, each rank its copy of the
    latent cache, and the prefix cache's host tier): the first run asks for the prompts' logprobs too (equal to
    transformers' log_softmax at every position, 1e-4), the second hits the first's cached blocks; greedy 48 tokens
    and their logprobs equal transformers' both times. Rank 0's pool holds the whole latent vector a token and
    layer."""
    path, hf, expected = checkpoints[model_type]
    with torch.inference_mode():
        want = [hf(torch.tensor([p])).logits[0].log_softmax(-1) for p in prompts()]
    asking = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0, prompt_logprobs=1)
    args = dict(dtype="float32", max_num_batched_tokens=32, max_model_len=128, num_kv_blocks=10)
    llm = LLM(str(path), tensor_parallel_size=2, distributed_timeout=60, **args, **tiers)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], asking, use_tqdm=False)
        assert_matches(outs, expected)
        for out, prompt, w in zip(outs, prompts(), want):
            assert_prompt_logprobs(out.prompt_logprobs, prompt, w, 1)
        assert_matches(llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY, use_tqdm=False), expected)
        stats = llm.llm_engine.stats()
        assert stats.prefix_cache_hits > 0 and llm.llm_engine.scheduler.num_preemptions > 0
        assert not tiers or (stats.swapped_out_seqs > 0 and stats.swapped_in_seqs > 0 and stats.host_tier_hits > 0)
        runner = llm.llm_engine.model_runner
    finally:
        llm.shutdown()
    latent = TINY["kv_lora_rank"] + TINY["qk_rope_head_dim"]
    assert runner.kv_spec.bytes_per_token == latent * TINY["num_hidden_layers"] * 4
    assert runner.model.model.layers[0].self_attn.num_heads == TINY["num_attention_heads"] // 2


@pytest.mark.parametrize("router", [DeepseekV2TopkRouter, DeepseekV3TopkRouter])
def test_grouped_topk_equals_transformers_router(checkpoints, router):
    """transformers' own router module on the same weights (groups, bias, renormalization, scaling) picks the same
    experts with the same weights, for 64 random tokens."""
    model_type = "deepseek_v2" if router is DeepseekV2TopkRouter else "deepseek_v3"
    path, hf = checkpoints[model_type][:2]
    theirs = hf.model.layers[1].mlp.gate
    ours: DeepseekMoE = build_model(get_model_config(path), path, "cpu", 256, "torch").model.layers[1].mlp
    x = torch.randn(64, TINY["hidden_size"], generator=torch.Generator().manual_seed(2))
    _, ref_weights, ref_experts = theirs(x)
    ds = ours.ds
    bias = ours.gate.e_score_correction_bias
    args = (ds.scoring, ds.num_groups, ds.topk_groups, bias, ours.renormalize, ds.routed_scaling_factor)
    weights, experts = grouped_topk(ours.gate(x), ours.top_k, *args)
    order, ref_order = experts.sort(-1), ref_experts.sort(-1)
    assert torch.equal(order.values, ref_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), ref_weights.gather(1, ref_order.indices))
    ungrouped = grouped_topk(ours.gate(x), ours.top_k, ds.scoring, 1, 1, bias)[1].sort(-1).values
    assert not torch.equal(ungrouped, order.values), "the group limit changes no choice: the test would prove little"


def test_unsupported_settings_are_refused_by_name(checkpoints):
    path = checkpoints["deepseek_v2"][0]
    config = get_model_config(path)
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by tensor_parallel_size 8"):
        build_model(config, path, "cpu", 256, "torch", TensorParallel(0, 8))
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8'.*latent \\(MLA\\) KV cache"):
        LLM(str(path), dtype="float32", kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="DeepseekV2ForCausalLM: LoRA adapters are not supported"):
        LLM(str(path), dtype="float32", enable_lora=True)
    raw = json.loads((path / "config.json").read_text())
    with pytest.raises(ValueError, match="topk_method 'noaux_tc' is not supported"):
        DeepseekConfig.from_hf({**raw, "topk_method": "noaux_tc"})
