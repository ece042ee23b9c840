"""Gemma 2 and Gemma 3 (text) on tiny random fp32 checkpoints written by transformers itself, against transformers
on the same weights.

Gemma 2: local/global layers alternating, a window of 8 keys, attention scores soft-capped at 5 and final logits
at 3, head_dim 32 (the torch path's window reference for prefill, the native decode's generic loop). Gemma 3:
`layer_types` local, local, global, local with a window of 12, q/k norms, its own RoPE per layer type (local theta
100, global 10000 with linear scaling x2), head_dim 64 (the native prefill and AVX-512 decode kernels where this CPU
has them). Both: `query_pre_attn_scalar` apart from head_dim, prompts and generations far longer than the window.

Greedy 48 tokens of a batch equal transformers' `generate` token for token with logprobs within 1e-4, run twice
(the second run's prompts hit the first's cached blocks) and again with prefill chunks of 16 tokens; every prompt
position's logprobs, the prompt computed in chunks that cross window boundaries (5, 11, then the rest), equal
transformers' forward within 1e-4, and differ from those of the model without its windows."""

import json

import pytest
import torch
from lora_adapters import PeftReference, make_adapter
from references import reference_generate, spread_weights
from transformers import AutoConfig, AutoModelForCausalLM

from tiffin import LLM, SamplingParams
from tiffin.engine.core.scheduler import SchedulerOutput
from tiffin.engine.core.sequence import Sequence
from tiffin.engine.errors import ParamError
from tiffin.engine.lora.request import LoRARequest
from tiffin.engine.models.gemma import GemmaConfig
from tiffin.engine.models.loader import get_model_config
from tiffin.tiny import write_tokenizer

VOCAB, NEW_TOKENS = 512, 48
TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
ARCHS = {
    "gemma2": dict(
        head_dim=32, query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=5.0, final_logit_softcapping=3.0
    ),
    "gemma3_text": dict(
        head_dim=64,
        query_pre_attn_scalar=48,
        sliding_window=12,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        },
    ),
}
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
# Gemma 2's own template (tokenizer_config.json of gemma-2-*-it): no system role, strict alternation
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    p = [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in (1, 7, 21, 40)]
    return p + [p[3][:32] + p[1]]  # shares two 16-token blocks with the 40-token prompt


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """model_type -> (its checkpoint's path, saved by transformers with a tokenizer; the transformers model)."""
    out = {}
    for model_type, extra in ARCHS.items():
        path = tmp_path_factory.mktemp(model_type)
        config = AutoConfig.for_model(model_type, **TINY, **extra)
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
        spread_weights(hf, 0.0, 1, 3.0)  # norms near 0, which Gemma adds to 1; embeddings times sqrt(hidden) in it
        hf.save_pretrained(path)
        write_tokenizer(path, VOCAB, False, TINY["max_position_embeddings"])
        tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
        (path / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "chat_template": GEMMA_TEMPLATE}))
        hf.generation_config.eos_token_id = None
        out[model_type] = path, hf
    return out


@pytest.fixture(scope="module")
def engines(checkpoints):
    """model_type -> an engine with prefix caching."""
    return {t: LLM(str(path), dtype="float32", enable_prefix_caching=True) for t, (path, _) in checkpoints.items()}


@pytest.fixture(scope="module")
def expected(checkpoints):
    return {t: [reference_generate(hf, p, NEW_TOKENS) for p in prompts()] for t, (_, hf) in checkpoints.items()}


def assert_greedy_matches(llm: LLM, expected: list) -> None:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY, use_tqdm=False)
    for prompt, out, (tokens, logprobs) in zip(prompts(), outs, expected):
        got = out.outputs[0]
        assert got.token_ids == tokens, f"prompt of {len(prompt)} tokens"
        got_lp = [step[t].logprob for step, t in zip(got.logprobs, got.token_ids)]
        assert max(abs(a - b) for a, b in zip(got_lp, logprobs)) < 1e-4, f"prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("model_type", list(ARCHS))
def test_greedy_batch_matches_transformers(engines, expected, model_type):
    llm = engines[model_type]
    config = llm.llm_engine.model_config
    assert llm.llm_engine.max_model_len == TINY["max_position_embeddings"] > 40 + NEW_TOKENS > 3 * config.sliding_window
    for _ in range(2):  # the second run's prompts hit the first's cached blocks
        assert_greedy_matches(llm, expected[model_type])
    assert llm.llm_engine.stats().prefix_cache_hits > 0
    assert len(set(expected[model_type][3][0])) > 8, "greedy decoding loops on a token: the test would prove little"


@pytest.mark.parametrize("model_type", list(ARCHS))
def test_chunked_prefill_matches_transformers(checkpoints, expected, model_type):
    """Prefill chunks of 16 tokens: chunks after a cached prefix, crossing the window's edge."""
    llm = LLM(str(checkpoints[model_type][0]), dtype="float32", max_num_batched_tokens=16, max_num_seqs=4)
    assert_greedy_matches(llm, expected[model_type])


def prompt_logprobs(llm: LLM, prompt: list[int], chunks: list[int]) -> torch.Tensor:
    """Every position's logprobs `[len(prompt), vocab]`, the prompt run through the engine's model in `chunks`, each
    reading the KV cache the chunks before wrote."""
    runner = llm.llm_engine.model_runner
    seq = Sequence("p", 0, prompt, SamplingParams(), 1)
    seq.block_table = list(range(-(-len(prompt) // runner.block_size)))
    rows = []
    with torch.inference_mode():
        for n in chunks:
            step = SchedulerOutput()
            step.add(seq, n)
            inputs = runner.prepare(step)
            hidden = runner.model(inputs.input_ids, inputs.positions, inputs.attn)
            rows.append(runner.model.compute_logits(hidden[:n]).log_softmax(-1))
            seq.num_computed_tokens += n
    return torch.cat(rows)


@pytest.mark.parametrize("model_type", list(ARCHS))
def test_prompt_logprobs_in_chunks_match_transformers(checkpoints, model_type):
    path, hf = checkpoints[model_type]
    llm = LLM(str(path), dtype="float32", enable_prefix_caching=False)  # its blocks are this test's to write
    prompt = prompts()[3]
    with torch.inference_mode():
        want = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
    got = prompt_logprobs(llm, prompt, [5, 11, len(prompt) - 16])
    assert (got - want).abs().max().item() < 1e-4
    attentions = [layer.self_attn for layer in llm.llm_engine.model_runner.model.model.layers]
    windows = [a.window for a in attentions]
    assert windows == list(GemmaConfig.from_hf(hf.config.to_dict()).windows) and any(windows)
    for a in attentions:  # without its windows the model answers otherwise: the comparison above can fail
        a.window = 0
    assert (prompt_logprobs(llm, prompt, [len(prompt)]) - want).abs().max().item() > 1e-2


def test_config_as_hub_checkpoints_spell_it():
    """Gemma 3's config.json from the hub: no layer_types (every 6th layer global), rope_theta + rope_scaling for
    the global layers, rope_local_base_freq for the local ones; Gemma 2's alternates."""
    raw = dict(model_type="gemma3_text", num_hidden_layers=7, sliding_window=512, rope_theta=1e6)
    raw |= dict(rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0})
    g = GemmaConfig.from_hf(raw)
    assert g.windows == (512, 512, 512, 512, 512, 0, 512) and g.attn_softcap == g.final_softcap == 0
    assert g.rope == {"full_attention": (1e6, {"rope_type": "linear", "factor": 8.0}), "sliding_attention": (1e4, None)}
    g2 = GemmaConfig.from_hf(dict(model_type="gemma2", num_hidden_layers=4, sliding_window=4096, rope_theta=1e4))
    assert g2.windows == (4096, 0, 4096, 0) and g2.rope["sliding_attention"] == g2.rope["full_attention"]
    with pytest.raises(ValueError, match="layer_types"):
        GemmaConfig.from_hf(dict(model_type="gemma2", num_hidden_layers=2, layer_types=["local", "global"]))


def test_gemma_chat_template_has_no_system_role(checkpoints, engines):
    """Gemma's template refuses a system turn by raising: tiffin answers with a ParamError naming `messages`
    and the template's words, and serves the next conversation."""
    from tiffin.engine.models.source import load_tokenizer

    llm = engines["gemma2"]
    with pytest.raises(ParamError, match="System role not supported") as e:
        llm.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], GREEDY)
    assert e.value.param == "messages"
    turns = [("user", "hi"), ("assistant", "yo"), ("user", "x")]
    hello = [{"role": role, "content": text} for role, text in turns]
    out = llm.chat(hello, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    tok = load_tokenizer(str(checkpoints["gemma2"][0]))
    want = tok.apply_chat_template(hello, add_generation_prompt=True, tokenize=True)
    assert out[0].prompt_token_ids == list(getattr(want, "input_ids", want)) and len(out[0].outputs[0].token_ids) == 4
    stats = llm.llm_engine.stats()
    assert stats.num_running == stats.num_waiting == 0


def test_architectures_resolve(checkpoints):
    for model_type, (path, _) in checkpoints.items():
        config = get_model_config(path)
        assert config.windowed and config.hidden_act == "gelu_pytorch_tanh" and config.tie_word_embeddings
        assert config.qk_norm == (model_type == "gemma3_text")


def test_lora_on_attention_and_mlp_matches_peft(checkpoints, tmp_path):
    """An adapter on q/k/v/o and the GeGLU's gate/up/down of Gemma 2 (soft-capped, windowed) equals PEFT's greedy
    output on the same transformers model."""
    path, hf = checkpoints["gemma2"]
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapter = make_adapter(path, tmp_path / "a", seed=1, model=hf, r=4, lora_alpha=8, target_modules=targets)
    prompt = prompts()[3]
    ref = PeftReference(hf, {"a": adapter})
    try:
        expected = ref.generate(prompt, "a", 16)
    finally:
        ref.model.unload()
    llm = LLM(str(path), dtype="float32", enable_lora=True, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, lora_request=LoRARequest("a", 1, str(adapter)))
    assert out[0].outputs[0].token_ids == expected
    assert expected != reference_generate(hf, prompt, 16)[0], "the adapter does not change the output"


@pytest.mark.slow  # a minute under the interpreter
def test_triton_kernels_match_the_torch_reference(checkpoints, monkeypatch):
    """Gemma 3 (q/k norms fused into the rotary KV write, windows) on the Triton kernels under the interpreter, in
    fp16 (Triton applies windows to 16-bit queries), against the torch backend's fp16 engine (its window reference,
    `_attend`, or the native kernels): the same tokens, logprobs within fp16 rounding."""
    path = checkpoints["gemma3_text"][0]
    prompt = prompts()[2]  # 21 tokens: past the window of 12
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    outs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        llm = LLM(str(path), dtype="float16", kernel_backend=backend, num_kv_blocks=16, max_num_seqs=2)
        outs[backend] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    torch_out, triton_out = outs["torch"], outs["triton"]
    assert triton_out.token_ids == torch_out.token_ids
    pairs = zip(triton_out.logprobs, torch_out.logprobs, torch_out.token_ids)
    assert max(abs(a[t].logprob - b[t].logprob) for a, b, t in pairs) < 2e-2


def test_pipeline_parallelism_is_refused_by_name(checkpoints):
    path, _ = checkpoints["gemma2"]
    with pytest.raises(ValueError, match="does not serve Gemma2ForCausalLM yet"):
        LLM(str(path), dtype="float32", pipeline_parallel_size=2)
