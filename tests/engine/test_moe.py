"""Mixtures of experts (models/moe.py) on tiny random checkpoints written by transformers itself: Mixtral (8 experts,
always renormalized), Qwen2-MoE (6 experts, a gated shared expert, its second layer dense by mlp_only_layers)
and Qwen3-MoE (8 experts, q/k norms, norm_topk_prob). Greedy generation of a batch (continuous batching, prefix
caching on, two prompts sharing a prefix, run twice so the second run reads cached blocks) equals transformers'
`generate` token for token, per-step logprobs within 1e-3; the fused expert layout transformers holds in memory
loads as the per-expert one it saves; tensor-parallel shards of a layer sum to the whole; an attention-only LoRA
adapter equals PEFT; quantized experts and adapters on experts are refused by name."""

import json
import shutil

import pytest
import torch
from lora_adapters import PeftReference, make_adapter
from references import reference_generate
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from tiffin import LLM, SamplingParams
from tiffin.engine.distributed.tensor_parallel import TensorParallel
from tiffin.engine.lora.request import LoRARequest
from tiffin.engine.models.config import MoEConfig
from tiffin.engine.models.loader import build_model, get_model_config
from tiffin.engine.models.moe import SparseMoE
from tiffin.tiny import write_tokenizer

VOCAB, NEW_TOKENS = 512, 16
TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    num_experts_per_tok=2,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
ARCHS = {
    "mixtral": dict(num_local_experts=8),
    "qwen2_moe": dict(num_experts=6, moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[1]),
    "qwen3_moe": dict(num_experts=8, moe_intermediate_size=32, head_dim=32, norm_topk_prob=True),
}
TP2 = (TensorParallel(0, 2), TensorParallel(1, 2))
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    p = [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in (1, 7, 21, 40)]
    return p + [p[3][:32] + p[1]]  # shares two 16-token blocks with the 40-token prompt


def randomize(model: torch.nn.Module) -> None:
    """Weights large enough that greedy decoding wanders and routing is decisive (transformers initializes with
    std 0.02: near-uniform logits and router probabilities, ties within float noise)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            x = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * x)
            elif name.endswith("bias"):
                p.copy_(0.2 * x)
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(x * 2.0 / p.shape[-1] ** 0.5)
            else:  # fan-in scaled; the router and the residual writes larger
                gain = 3.0 if name.endswith(("gate.weight", "o_proj.weight", "down_proj", "down_proj.weight")) else 1.0
                p.copy_(x * gain / p.shape[-1] ** 0.5)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """model_type -> (path of its checkpoint, saved by transformers, with a tokenizer; the transformers model)."""
    out = {}
    for model_type, extra in ARCHS.items():
        path = tmp_path_factory.mktemp(model_type)
        config = AutoConfig.for_model(model_type, **TINY, **extra)
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        randomize(hf)
        hf.save_pretrained(path)
        write_tokenizer(path, VOCAB, model_type.startswith("qwen"), TINY["max_position_embeddings"])
        hf.generation_config.eos_token_id = None
        out[model_type] = path, hf
    return out


@pytest.mark.parametrize("model_type", list(ARCHS))
def test_greedy_batch_matches_transformers(checkpoints, model_type):
    path, hf = checkpoints[model_type]
    expected = [reference_generate(hf, p, NEW_TOKENS) for p in prompts()]
    llm = LLM(str(path), dtype="float32", enable_prefix_caching=True)
    for _ in range(2):  # the second run's prompts hit the first's cached blocks
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY, use_tqdm=False)
        for prompt, out, (tokens, logprobs) in zip(prompts(), outs, expected):
            got = out.outputs[0]
            assert got.token_ids == tokens, f"prompt of {len(prompt)} tokens"
            got_lp = [step[t].logprob for step, t in zip(got.logprobs, got.token_ids)]
            assert max(abs(a - b) for a, b in zip(got_lp, logprobs)) < 1e-3
    assert llm.llm_engine.stats().prefix_cache_hits > 0
    assert len(set(expected[3][0])) > 4, "greedy decoding loops on a token: the test would prove little"


def test_layers_are_sparse_as_the_config_says(checkpoints):
    model = build_model(get_model_config(checkpoints["qwen2_moe"][0]), checkpoints["qwen2_moe"][0], "cpu", 64, "torch")
    assert [isinstance(layer.mlp, SparseMoE) for layer in model.model.layers] == [True, False]
    moe = MoEConfig(8, 2, 32, False, sparse_step=2, dense_layers=(3,))
    assert [moe.sparse(i) for i in range(6)] == [False, True, False, False, False, True]
    mixtral = get_model_config(checkpoints["mixtral"][0]).moe
    assert mixtral.renormalize and mixtral.num_experts == 8 and mixtral.intermediate_size == 96


def test_fused_experts_load_as_per_expert_ones(checkpoints, tmp_path):
    """transformers 5 holds experts fused (`mlp.experts.gate_up_proj [E, 2I, H]`) and saves them per expert
    (Mixtral's as `block_sparse_moe.experts.{e}.w1/w2/w3`): a checkpoint of the fused tensors loads the same."""
    for model_type in ("mixtral", "qwen3_moe"):
        path, hf = checkpoints[model_type]
        saved = {k: v.contiguous() for k, v in hf.state_dict().items()}
        assert any(k.endswith("mlp.experts.gate_up_proj") for k in saved)
        fused = tmp_path / model_type
        shutil.copytree(path, fused, ignore=shutil.ignore_patterns("*.safetensors"))
        save_file(saved, str(fused / "model.safetensors"), metadata={"format": "pt"})
        config = get_model_config(path)
        a, b = (build_model(config, p, "cpu", 64, "torch") for p in (path, fused))
        for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
            assert torch.equal(x, y), name
    del saved["model.layers.1.mlp.experts.down_proj"]
    save_file(saved, str(fused / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks weights for: model\.layers\.1\.mlp\.experts\.down_proj"):
        build_model(config, fused, "cpu", 64, "torch")


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_tensor_parallel_shards_sum_to_the_whole_layer(checkpoints, model_type, monkeypatch):
    """Ranks 0 and 1 of 2 built in this process (all-reduce left out): each holds half of every expert's
    intermediate dimension (and of the shared expert's), the router whole; their outputs sum to the whole layer's."""
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda x, group=None: x)
    path = checkpoints[model_type][0]
    config = get_model_config(path)
    whole, *ranks = (build_model(config, path, "cpu", 64, "torch", tp) for tp in (TensorParallel(), *TP2))
    x = torch.randn(9, TINY["hidden_size"], generator=torch.Generator().manual_seed(1))
    layers = [m.model.layers[0].mlp for m in (whole, *ranks)]
    with torch.inference_mode():
        expected = layers[0](x)
        got = layers[1](x) + layers[2](x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    half = layers[0].experts.down_proj.shape[2] // 2
    assert layers[2].experts.down_proj.shape[2] == half
    assert torch.equal(layers[2].experts.down_proj, layers[0].experts.down_proj[:, :, half:])


def test_lora_off_the_experts_matches_peft_and_on_them_is_refused(checkpoints, tmp_path):
    """PEFT targets attention, the shared expert and the dense layer's MLP; an adapter with weights for an expert is
    refused by name. The MLP targets are named by their parents: PEFT 0.22 reads a bare `gate_proj` as the fused
    experts' too (and refuses it without `up_proj`)."""
    path, hf = checkpoints["qwen2_moe"]
    targets = ["q_proj", "v_proj"] + [
        f"{parent}.{proj}" for parent in ("mlp", "shared_expert") for proj in ("gate_proj", "down_proj")
    ]
    adapter = make_adapter(path, tmp_path / "a", seed=1, model=hf, r=4, lora_alpha=8, target_modules=targets)
    weights = load_file(adapter / "adapter_model.safetensors")
    assert any("shared_expert.gate_proj" in k for k in weights) and not any(".experts." in k for k in weights)
    experts = tmp_path / "experts"
    shutil.copytree(adapter, experts)
    key = "base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_{}.weight"
    expert = {key.format("A"): torch.zeros(4, TINY["hidden_size"]), key.format("B"): torch.zeros(32, 4)}
    save_file({**weights, **expert}, str(experts / "adapter_model.safetensors"))
    prompt = prompts()[2]
    ref = PeftReference(hf, {"a": adapter})
    llm = LLM(str(path), dtype="float32", enable_lora=True, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, lora_request=LoRARequest("a", 1, str(adapter)))
    expected = ref.generate(prompt, "a", NEW_TOKENS)
    ref.model.unload()
    assert out[0].outputs[0].token_ids == expected
    assert expected != reference_generate(hf, prompt, NEW_TOKENS)[0], "the adapter does not change the output"
    with pytest.raises(ValueError, match=r"mlp\.experts\.0\.gate_proj: adapters on a mixture of experts' experts"):
        llm.generate([{"prompt_token_ids": prompt}], params, lora_request=LoRARequest("e", 2, str(experts)))


@pytest.mark.parametrize(
    "quantization_config, quantization",
    [({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}, None), (None, "fp8")],
    ids=["gptq-checkpoint", "fp8-at-load"],
)
def test_quantized_experts_are_refused(checkpoints, tmp_path, quantization_config, quantization):
    path = tmp_path / "q"
    shutil.copytree(checkpoints["qwen3_moe"][0], path)
    if quantization_config:
        raw = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**raw, "quantization_config": quantization_config}))
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM quantized with .*: quantized experts are not supported"):
        get_model_config(path, quantization=quantization)


@pytest.mark.slow
@pytest.mark.subprocess
def test_tensor_parallel_engine_matches_transformers(checkpoints):
    """TP=2 worker processes (gloo on CPU): each rank's experts all-reduced, greedy still equals transformers."""
    path, hf = checkpoints["qwen2_moe"]
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=2, distributed_timeout=30)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == [reference_generate(hf, p, NEW_TOKENS)[0] for p in prompts()]
