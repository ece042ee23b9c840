"""Warm-up launches every Triton kernel variant before the engine is ready: under the interpreter (which compiles
nothing) the variants are recorded as Triton specializes them, and serving must launch none that warm-up did not."""

import pytest
import torch
from lora_adapters import ADAPTERS, make_adapter
from transformers import AutoModelForCausalLM

from tiffin import LLM, LoRARequest, SamplingParams
from tiffin.engine.worker.warm_up import warm_up_lora, warm_up_triton
from tiffin.kernels import triton_common as tc

pytestmark = [pytest.mark.slow]

PROMPTS = [
    "Hello, tiffin",
    "The quick brown fox jumps over the lazy dog " * 12,  # 266 tokens: chunked prefill, decodes split their KV
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16",
    "a",
]
# the LoRA kernels' variants follow the step's tokens and slots, not the context: two steps' worth is chunked enough
LORA_PROMPTS = [PROMPTS[0], "The quick brown fox jumps over the lazy dog " * 5, *PROMPTS[2:]]


@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_no_kernel_variant_is_first_launched_after_warm_up(tiny_model, interpreter):
    """On CUDA the runner warms up when it starts; on CPU it is called here, on the same runner."""
    llm = LLM(
        tiny_model("llama"),
        dtype="float32",
        kernel_backend="triton",
        num_kv_blocks=64,
        max_num_seqs=4,
        max_num_batched_tokens=64,
    )
    with tc.recording_launches() as warm:
        warm_up_triton(llm.llm_engine.model_runner)
    kernels = {variant[0] for variant in warm}
    model_kernels = {"_rms_norm_kernel", "_rotary_write_kv_kernel", "_act_and_mul_kernel"}  # the fused ones
    assert {"_paged_attention_kernel", "_merge_splits_kernel"} | model_kernels <= kernels, kernels
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, max_tokens=5, n=2, seed=1, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
    ]
    with tc.recording_launches() as served:
        llm.generate(PROMPTS, params, use_tqdm=False)
        llm.generate(PROMPTS[1:3], params[:2], use_tqdm=False)  # prefix-cache hits: prefills after a cached prefix
    assert served, "serving launched no Triton kernel"
    new = served - warm
    assert not new, f"{len(new)} variants first launched while serving, e.g. {sorted(new, key=str)[:2]}"


def test_no_lora_kernel_variant_is_first_launched_after_warm_up(tiny_model, interpreter, tmp_path):
    """The LoRA kernels' warm-up (`warm_up_lora`, part of `warm_up_triton`), then steps mixing the base model and
    two adapters, prefill chunks of one slot and decodes of several: no LoRA variant is new."""
    base = tiny_model("llama")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    names = ["qv-r8", "all-rslora-r16"]
    loras = [
        LoRARequest(n, i + 1, str(make_adapter(base, tmp_path / n, i, model, **ADAPTERS[n])))
        for i, n in enumerate(names)
    ]
    llm = LLM(
        base,
        dtype="float32",
        kernel_backend="triton",
        enable_lora=True,
        max_loras=2,
        num_kv_blocks=64,
        max_num_seqs=4,
        max_num_batched_tokens=64,
    )
    with tc.recording_launches() as warm:
        warm_up_lora(llm.llm_engine.model_runner)
    assert {variant[0] for variant in warm} == {"_lora_shrink_kernel", "_lora_expand_kernel"}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with tc.recording_launches() as served:
        llm.generate(LORA_PROMPTS, params, use_tqdm=False, lora_request=[loras[0], None, loras[1], loras[0]])
    lora_served = {v for v in served if v[0] in ("_lora_shrink_kernel", "_lora_expand_kernel")}
    assert lora_served, "serving launched no LoRA kernel"
    new = lora_served - warm
    assert not new, f"{len(new)} LoRA variants first launched while serving, e.g. {sorted(new, key=str)[:2]}"
