"""Decode steps of int8 models on CPU in one native call (`engine/worker/cpu_decode.py`) against the model's torch
code on the same kernels: each layer equal to float rounding (SiLU's exp is the native step's own), in bf16 the
whole step bit for bit, and generation through the engine with the same tokens."""

import ctypes
from pathlib import Path

import pytest
import torch
from decode_steps import decode_inputs
from gguf import GGMLQuantizationType as QType
from gguf_files import write_gguf

from tiffin import LLM, SamplingParams
from tiffin.kernels import cpu_native

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="no C++ compiler: no native kernels")
WRITTEN = {"llama": QType.Q4_0, "mistral": QType.Q8_0, "qwen2": QType.Q8_0, "qwen3": QType.Q4_0}
QUANT = Path(__file__).parents[1] / "fixtures" / "quant"


@pytest.fixture(scope="module")
def gguf_model(tiny_model, tmp_path_factory):
    paths = {}

    def get(arch: str):
        if arch not in paths:
            paths[arch] = write_gguf(tiny_model(arch), tmp_path_factory.mktemp(arch) / f"{arch}.gguf", WRITTEN[arch])
        return paths[arch]

    return get


def native_layers(llm: LLM, inputs, num_layers: int) -> torch.Tensor:
    """The hidden state after the first `num_layers` decoder layers, natively."""
    decoder, attn = llm.llm_engine.model_runner.cpu_decoder, inputs.attn
    x = decoder.model.model.embed_tokens(inputs.input_ids).contiguous()
    header = decoder.decoder
    saved, header.num_layers = header.num_layers, num_layers
    try:
        cpu_native.library().tiffin_decode_layers(
            ctypes.addressof(header), x.data_ptr(), len(x), inputs.positions.data_ptr(),
            attn.slot_mapping.data_ptr(), attn.block_tables.data_ptr(), attn.block_tables.stride(0),
            attn.seq_lens.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
    finally:
        header.num_layers = saved
    return x


PROMPTS = [[5, 9, 300, 17, 1200, 44, 8], [1, 2, 3, 4], list(range(100, 140))]


@pytest.mark.parametrize("arch", WRITTEN)
def test_each_layer_is_the_torch_layer(gguf_model, arch):
    llm = LLM(str(gguf_model(arch)), dtype="float32", num_kv_blocks=16)
    runner = llm.llm_engine.model_runner
    assert runner.cpu_decoder is not None
    inputs = decode_inputs(llm, PROMPTS)
    layers = runner.model.model.layers
    with torch.inference_mode():
        x = runner.model.model.embed_tokens(inputs.input_ids)
        for i, layer in enumerate(layers):
            mlp_out, residual = layer(x, None, runner.model.model.rotary.at(inputs.positions), inputs.attn, None)
            want = residual + mlp_out  # the layer leaves its last residual add to the next norm's kernel
            got = native_layers(llm, inputs, i + 1)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))
            x = got  # the next layer from the same input on both sides: a flipped int8 code stays local


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_steps_are_bit_identical(gguf_model, arch, kv_cache_dtype):
    """Quantized KV caches too: the native step writes and reads them with the torch path's kernels."""
    llm = LLM(str(gguf_model(arch)), dtype="bfloat16", num_kv_blocks=16, kv_cache_dtype=kv_cache_dtype)
    runner = llm.llm_engine.model_runner
    inputs = decode_inputs(llm, PROMPTS)
    with torch.inference_mode():
        want = runner.model(inputs.input_ids, inputs.positions, inputs.attn)
        got = runner.cpu_decoder(inputs.input_ids, inputs.positions, inputs.attn)
    assert torch.equal(got, want)


@pytest.mark.parametrize("compute", ["native", "int8"])
@pytest.mark.parametrize("arch", WRITTEN)
def test_generation_takes_the_native_steps_and_the_same_tokens(gguf_model, arch, compute, monkeypatch):
    # no prefix cache: the second run's prompts compute as the first's did (in native mode a step's arithmetic
    # follows its size: 15-bit activations for decode-sized steps, bf16 dot products for prompt-sized ones)
    llm = LLM(
        str(gguf_model(arch)),
        dtype="bfloat16",
        num_kv_blocks=64,
        max_num_seqs=4,
        cpu_quant_compute=compute,
        enable_prefix_caching=False,
    )
    runner = llm.llm_engine.model_runner
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1),
        SamplingParams(max_tokens=9, seed=3),
    ]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    calls, native = [], runner.cpu_decoder.__call__
    monkeypatch.setattr(runner, "cpu_decoder", lambda *a: calls.append(len(a[0])) or native(*a))
    got = [llm.generate(prompts, p, use_tqdm=False) for p in params]
    assert calls and max(calls) == len(PROMPTS)  # decode steps of the whole batch ran natively
    monkeypatch.setattr(runner, "cpu_decoder", None)
    want = [llm.generate(prompts, p, use_tqdm=False) for p in params]
    for g, w in zip(sum(got, []), sum(want, [])):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs


def test_adapters_exact_mode_and_act_order_keep_the_torch_steps(gguf_model):
    assert LLM(str(gguf_model("llama")), cpu_quant_compute="exact").llm_engine.model_runner.cpu_decoder is None
    assert LLM(str(gguf_model("llama")), enable_lora=True).llm_engine.model_runner.cpu_decoder is None
    act_order = LLM(str(QUANT / "gptq-4bit-g64-actorder-sym"), num_kv_blocks=16)  # its inputs are permuted first
    assert act_order.llm_engine.model_runner.cpu_decoder is None


@pytest.mark.parametrize("name", ["awq-g64", "gptq-4bit-g32-asym", "gptq-8bit-perchannel-sym"])
def test_awq_and_gptq_steps_are_the_torch_steps(name, monkeypatch):
    llm = LLM(str(QUANT / name), dtype="bfloat16", num_kv_blocks=64, enable_prefix_caching=False)
    runner = llm.llm_engine.model_runner
    assert runner.cpu_decoder is not None
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": [t % 512 for t in p]} for p in PROMPTS]  # the fixtures' vocabulary
    got = llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(runner, "cpu_decoder", None)
    want = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].logprobs for o in got] == [o.outputs[0].logprobs for o in want]
