"""Dense families beside Llama on tiny random checkpoints written by transformers itself: Phi-3 (q/k/v and gate/up
fused in its checkpoint, LongRoPE with its attention factor: its short factors within the pretraining length, its
long ones past it), SmolLM3 (every fourth layer without RoPE), Granite (its four multipliers) and OLMo 2 (norms
after the sublayers, q/k norms over the whole projection). Greedy generation of a batch (two prompts sharing a
prefix, run twice so that the second run hits the first's cached blocks, prompts prefilled in chunks) equals
transformers' `generate` token for token for 48 tokens, per-step logprobs within 1e-4; the RoPE scalings equal
transformers' own init functions; Granite's and Phi-3's LoRA adapters equal PEFT; TP=2 on Phi-3 and OLMo 2, the
CUDA path under the emulation (Triton interpreted, decode graphs replayed) and GGUF files of Granite and SmolLM3
equal transformers too."""

import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf_files import write_gguf
from lora_adapters import PeftReference, make_adapter
from references import reference_generate, spread_weights
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tiffin import LLM, SamplingParams
from tiffin.engine.lora.request import LoRARequest
from tiffin.engine.models.config import ModelConfig
from tiffin.engine.models.layers import rope_inv_freq
from tiffin.engine.models.loader import get_model_config
from tiffin.engine.worker import model_runner
from tiffin.tiny import BOS_ID, IM_END_ID, PAD_ID, write_tokenizer

VOCAB, NEW_TOKENS, ORIGINAL = 512, 48, 80
TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    pad_token_id=PAD_ID,
    bos_token_id=BOS_ID,
    eos_token_id=IM_END_ID,
)


def longrope(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    factors = lambda low, high: (low + (high - low) * torch.rand(8, generator=g)).sort().values.tolist()  # noqa: E731
    return {"rope_type": "longrope", "short_factor": factors(1.0, 1.2), "long_factor": factors(1.0, 6.0)}


ARCHS = {
    "phi3": dict(rope_scaling=longrope(0), original_max_position_embeddings=ORIGINAL),
    "smollm3": dict(no_rope_layer_interval=4),  # layer 3 without RoPE
    "granite": dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=2.5),
    "olmo2": dict(),
}
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)


def prompts(lengths=(1, 7, 21, 40)) -> list[list[int]]:
    g = torch.Generator().manual_seed(sum(lengths))
    p = [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in lengths]
    return p + [p[-1][:32] + p[1]]  # shares two 16-token blocks with the longest prompt


LONG = (90, 100, 120)  # past Phi-3's pretraining length: its long factors
SHORT = (1, 7, 30)  # within it, 48 tokens on too: its short factors


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """model_type -> (path of its checkpoint, saved by transformers, with a tokenizer; the transformers model)."""
    out = {}
    for model_type, extra in ARCHS.items():
        path = tmp_path_factory.mktemp(model_type)
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **TINY, **extra), dtype=torch.float32)
        spread_weights(hf.eval(), 1.0, 0.5, 2.0)
        hf.save_pretrained(path)
        write_tokenizer(path, VOCAB, False, TINY["max_position_embeddings"])
        hf.generation_config.eos_token_id = None
        out[model_type] = path, hf
    return out


def check_greedy(path, hf, batch: list[list[int]], **engine_args) -> LLM:
    expected = [reference_generate(hf, p, NEW_TOKENS) for p in batch]
    assert len(set(expected[-2][0])) > 4, "greedy decoding loops on a token: the test would prove little"
    llm = LLM(str(path), dtype="float32", enable_prefix_caching=True, max_num_batched_tokens=37, **engine_args)
    for _ in range(2):  # the second run's prompts hit the first's cached blocks
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)
        for prompt, out, (tokens, logprobs) in zip(batch, outs, expected):
            got = out.outputs[0]
            assert got.token_ids == tokens, f"prompt of {len(prompt)} tokens"
            got_lp = [step[t].logprob for step, t in zip(got.logprobs, got.token_ids)]
            assert max(abs(a - b) for a, b in zip(got_lp, logprobs)) < 1e-4
    assert llm.llm_engine.stats().prefix_cache_hits > 0
    return llm


@pytest.mark.parametrize("model_type", ["smollm3", "granite", "olmo2"])
def test_greedy_batch_matches_transformers(checkpoints, model_type):
    check_greedy(*checkpoints[model_type], prompts())


def test_phi3_long_factors_past_the_pretraining_length(checkpoints):
    """The engine serves 256 positions, past the 64 of pretraining: long factors for every sequence, as
    transformers uses them for prompts past 64 tokens."""
    check_greedy(*checkpoints["phi3"], prompts(LONG))


def test_phi3_short_factors_within_the_pretraining_length(checkpoints):
    """An engine of 80 positions (the pretraining length): short factors, as transformers' within it; an engine
    of 256 differs from transformers on the same short prompt (its long factors)."""
    path, hf = checkpoints["phi3"]
    batch = prompts(SHORT)[:-1]  # the shared-prefix prompt would run past 80 positions
    check_greedy(path, hf, batch, max_model_len=ORIGINAL)
    long = LLM(str(path), dtype="float32").generate([{"prompt_token_ids": batch[2]}], GREEDY, use_tqdm=False)
    assert long[0].outputs[0].token_ids != reference_generate(hf, batch[2], NEW_TOKENS)[0]


def test_nope_layers_are_read_from_either_setting(checkpoints):
    path, hf = checkpoints["smollm3"]
    raw = hf.config.to_dict()
    assert raw["no_rope_layers"] == [1, 1, 1, 0]
    assert ModelConfig.from_hf(raw, None).nope_layers == (3,)
    del raw["no_rope_layers"]
    assert ModelConfig.from_hf(raw, None).nope_layers == (3,)


ROPE_CONFIGS = {
    "llama3": (
        "llama",
        dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64),
    ),
    "yarn": ("qwen3", dict(factor=4.0, original_max_position_embeddings=64)),
    "yarn-mscale": ("qwen3", dict(factor=4.0, original_max_position_embeddings=64, mscale=0.7, mscale_all_dim=0.5)),
    "yarn-betas": ("qwen3", dict(factor=2.0, beta_fast=16, beta_slow=2, truncate=False)),
    "longrope": ("phi3", dict(longrope(1), attention_factor=None)),
}


@pytest.mark.parametrize("name", list(ROPE_CONFIGS))
@pytest.mark.parametrize("max_positions", [64, 256])
def test_rope_scaling_equals_transformers_init(name, max_positions):
    """Inverse frequencies and attention factor equal to transformers' rope init functions (LongRoPE's by the
    engine's context length, as transformers picks them by the sequence's)."""
    model_type, params = ROPE_CONFIGS[name]
    kind = "longrope" if name == "longrope" else name.split("-")[0]
    params = {k: v for k, v in params.items() if v is not None}
    extra = {"original_max_position_embeddings": ORIGINAL} if model_type == "phi3" else {}
    hf = AutoConfig.for_model(model_type, **TINY, **extra, rope_scaling={"rope_type": kind, **params})
    expected, attention = ROPE_INIT_FUNCTIONS[kind](hf, "cpu", seq_len=max_positions)
    config = ModelConfig.from_hf(hf.to_dict() | {"architectures": ["X"]}, None)
    got, got_attention = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling, max_positions)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    assert got_attention == pytest.approx(attention, rel=1e-12)


@pytest.mark.parametrize("scaling", [{"rope_type": "dynamic", "factor": 2.0}, {"partial_rotary_factor": 0.5}])
def test_unsupported_rope_is_refused_by_name(scaling):
    raw = {**TINY, "architectures": ["Phi3ForCausalLM"], "num_attention_heads": 4, "rope_scaling": scaling}
    with pytest.raises(ValueError, match="dynamic|partial rotary"):
        ModelConfig.from_hf(raw, None)


LORA = {  # model_type -> (PEFT's targets, a prompt: past Phi-3's pretraining length, as the engine serves it)
    "granite": (["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"], prompts()[2]),
    "phi3": (["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], prompts(LONG)[0]),  # its fused layers
}


@pytest.mark.parametrize("model_type", LORA)
def test_lora_matches_peft(checkpoints, model_type, tmp_path):
    """Granite's adapter deltas join the residual stream scaled as the layers' outputs; Phi-3's adapters target its
    fused layers, one A and one B over all of their shards."""
    path, hf = checkpoints[model_type]
    targets, prompt = LORA[model_type]
    adapter = make_adapter(path, tmp_path / "a", seed=1, model=hf, r=4, lora_alpha=8, target_modules=targets)
    ref = PeftReference(hf, {"a": adapter})
    expected = ref.generate(prompt, "a", NEW_TOKENS)
    ref.model.unload()
    assert expected != reference_generate(hf, prompt, NEW_TOKENS)[0], "the adapter does not change the output"
    llm = LLM(str(path), dtype="float32", enable_lora=True, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, lora_request=LoRARequest("a", 1, str(adapter)))
    assert out[0].outputs[0].token_ids == expected


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("model_type, kv_heads", [("phi3", 2), ("olmo2", 2), ("olmo2", 1)])
def test_tensor_parallel_engine_matches_transformers(checkpoints, model_type, kv_heads, tmp_path):
    """TP=2 worker processes (gloo on CPU): Phi-3's fused tensors split per shard and rank, OLMo 2's q/k norms over
    the ranks' heads together (with one KV head, both ranks hold it); greedy still equals transformers."""
    path, hf = checkpoints[model_type]
    if kv_heads != TINY["num_key_value_heads"]:
        config = AutoConfig.for_model(model_type, **(TINY | {"num_key_value_heads": kv_heads}), **ARCHS[model_type])
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        spread_weights(hf.eval(), 1.0, 0.5, 2.0)
        path = tmp_path / "mqa"
        hf.save_pretrained(path)
        write_tokenizer(path, VOCAB, False, TINY["max_position_embeddings"])
        hf.generation_config.eos_token_id = None
    batch = prompts(LONG if model_type == "phi3" else (1, 7, 21, 40))
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=2, distributed_timeout=30)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == [reference_generate(hf, p, NEW_TOKENS)[0] for p in batch]


@pytest.mark.parametrize("model_type", ["granite", "smollm3", "olmo2"])
def test_gguf_as_llama_cpp_writes_it_matches_transformers(checkpoints, model_type, tmp_path):
    """The checkpoint as a GGUF laid out as llama.cpp's converter writes it (q/k rows interleaved but OLMo 2's,
    Granite's multipliers as its scale keys, SmolLM3's NoPE layers implied: every 4th, OLMo 2's post-norms and
    projection-wide q/k norms): the config read from its metadata
    equals the Hugging Face one where it matters, and greedy tokens and logprobs (F32 weights) transformers'."""
    path, hf = checkpoints[model_type]
    gguf = write_gguf(path, tmp_path / f"{model_type}.gguf", QType.F32)
    want, got = get_model_config(path), get_model_config(gguf)
    assert got.nope_layers == want.nope_layers
    for field in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
        assert getattr(got, field) == pytest.approx(getattr(want, field)), field  # float32 in the file
    batch = prompts()[1:3]
    llm = LLM(str(gguf), dtype="float32")
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)
    for prompt, out in zip(batch, outs):
        tokens, logprobs = reference_generate(hf, prompt, NEW_TOKENS)
        assert out.outputs[0].token_ids == tokens
        got_lp = [step[t].logprob for step, t in zip(out.outputs[0].logprobs, tokens)]
        assert max(abs(a - b) for a, b in zip(got_lp, logprobs)) < 1e-4


def test_native_cpu_decode_steps_run_phi3_alone(checkpoints, monkeypatch):
    """Weights quantized to FP8 at load: Phi-3's block is Llama's (its LongRoPE in the tables and the softmax scale
    the native step reads), so its decode steps run natively, with the torch steps' tokens and logprobs; the
    others' blocks differ (NoPE layers, multipliers, post-norms): they keep the torch steps."""
    for model_type in ("smollm3", "granite", "olmo2"):
        llm = LLM(str(checkpoints[model_type][0]), dtype="bfloat16", quantization="fp8", num_kv_blocks=16)
        assert llm.llm_engine.model_runner.cpu_decoder is None, model_type
    llm = LLM(str(checkpoints["phi3"][0]), dtype="bfloat16", quantization="fp8", enable_prefix_caching=False)
    runner = llm.llm_engine.model_runner
    if runner.cpu_decoder is None:
        pytest.skip("no native FP8 decode step on this CPU (AVX-512 BF16) or no native kernels")
    batch = [{"prompt_token_ids": p} for p in prompts(LONG)[:2]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    calls, native = [], runner.cpu_decoder.__call__
    monkeypatch.setattr(runner, "cpu_decoder", lambda *a: calls.append(len(a[0])) or native(*a))
    got = llm.generate(batch, params, use_tqdm=False)
    assert calls
    monkeypatch.setattr(runner, "cpu_decoder", None)
    want = llm.generate(batch, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].logprobs for o in got] == [o.outputs[0].logprobs for o in want]


SMALL, SMALL_TOKENS = prompts((3, 9))[:2], 6  # the interpreter costs by the token


@pytest.fixture(scope="module")
def small_references(checkpoints):
    """model_type -> transformers' greedy tokens and logprobs for SMALL: computed before (module scope) the
    emulation of CUDA starts, which transformers' generate does not run under."""
    return {t: [reference_generate(hf, p, SMALL_TOKENS) for p in SMALL] for t, (_, hf) in checkpoints.items()}


EMULATED = [t if t == "smollm3" else pytest.param(t, marks=pytest.mark.slow) for t in ARCHS]  # 20 s each


@pytest.mark.parametrize("model_type", EMULATED)
def test_cuda_graphs_under_the_emulation_match_transformers(
    checkpoints, small_references, model_type, cuda_emulation, monkeypatch
):
    """The CUDA path on CPU (Triton under the interpreter): the fused rotary-and-KV-write kernel with LongRoPE's
    tables, the identity of NoPE layers and the scales of Granite, decode steps replayed from graphs."""
    monkeypatch.setattr(model_runner, "warm_up_triton", lambda runner: None)
    path = checkpoints[model_type][0]
    llm = LLM(str(path), device="cuda", dtype="float32", max_num_seqs=2, max_model_len=ORIGINAL, num_kv_blocks=16)
    params = SamplingParams(temperature=0, max_tokens=SMALL_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in SMALL], params, use_tqdm=False)
    assert cuda_emulation.replays > 0
    for out, (tokens, logprobs) in zip(outs, small_references[model_type]):
        got = out.outputs[0]
        assert got.token_ids == tokens
        got_lp = [step[t].logprob for step, t in zip(got.logprobs, got.token_ids)]
        assert max(abs(a - b) for a, b in zip(got_lp, logprobs)) < 1e-4
