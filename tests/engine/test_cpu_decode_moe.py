"""Decode steps of a GGUF mixture of experts on CPU in one native call (`engine/worker/cpu_decode.py`: the router
and one grouped GEMM a projection over the chosen experts) against the model's torch code (`models/moe.py`), on
tiny Qwen3-MoE, Mixtral and Qwen2-MoE (a shared expert) files as llama.cpp's converter and `llama-quantize` write
them (test_moe_gguf's checkpoints): each layer equal to float rounding (fp32), the whole step bit for bit (bf16),
generation through the engine with the same tokens, and the experts no token chose never read (their scales NaN,
the step unchanged). Skipped without llama.cpp, as test_moe_gguf."""

import pytest
import torch
from decode_steps import decode_inputs
from test_cpu_decode import native_layers
from test_moe import ARCHS
from test_moe_gguf import QUANTIZE, convert

from tiffin import LLM, SamplingParams
from tiffin.kernels import cpu_native
from tiffin.kernels.block_gemm import parts
from tiffin.testing.llama_cpp import run_peer

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="no C++ compiler: no native kernels")
PROMPTS = [[5, 9, 300, 17, 120, 44, 8], [1, 2, 3, 4], list(range(100, 140))]
# Qwen2-MoE: a shared expert in whole blocks, every layer sparse (llama.cpp's converter writes no dense layers)
QWEN2_MOE = {**ARCHS["qwen2_moe"], "shared_expert_intermediate_size": 64, "mlp_only_layers": []}
CONFIGS = {"qwen3_moe": ARCHS["qwen3_moe"], "mixtral": ARCHS["mixtral"], "qwen2_moe": QWEN2_MOE}


@pytest.fixture(scope="module", params=list(CONFIGS))
def files(request, tmp_path_factory):
    """{file type: the tiny MoE GGUF llama.cpp wrote}: Q8_0 by its converter, Q4_0 by `llama-quantize` (which
    writes Qwen2-MoE's shared-expert gate 1-d)."""
    tmp = tmp_path_factory.mktemp(request.param)
    written, _ = convert(request.param, CONFIGS[request.param], tmp)
    run_peer([QUANTIZE, written["f32"], written["q4_0"], "Q4_0"])
    return {qtype: written[qtype] for qtype in ("q8_0", "q4_0")}


def moe_layers(llm: LLM) -> list[torch.nn.Module]:
    return [layer.mlp for layer in llm.llm_engine.model_runner.model.model.layers if hasattr(layer.mlp, "experts")]


@pytest.mark.parametrize("outtype", ["q8_0", "q4_0"])
def test_each_layer_is_the_torch_layer(files, outtype):
    llm = LLM(str(files[outtype]), dtype="float32", num_kv_blocks=16)
    runner = llm.llm_engine.model_runner
    assert runner.cpu_decoder is not None and moe_layers(llm)
    inputs = decode_inputs(llm, PROMPTS)
    with torch.inference_mode():
        x = runner.model.model.embed_tokens(inputs.input_ids)
        for i, layer in enumerate(runner.model.model.layers):
            mlp_out, residual = layer(x, None, runner.model.model.rotary.at(inputs.positions), inputs.attn, None)
            want = residual + mlp_out
            got = native_layers(llm, inputs, i + 1)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))
            x = got


def test_unchosen_experts_are_never_read(files):
    """Every expert no token of the step chose gets NaN scales: a kernel that read its weights would spread them."""
    llm = LLM(str(files["q8_0"]), dtype="float32", num_kv_blocks=16)
    runner, layers = llm.llm_engine.model_runner, moe_layers(llm)
    inputs = decode_inputs(llm, PROMPTS)
    chosen = []
    hooks = [m.experts.register_forward_hook(lambda mod, args, out: chosen.append(set(args[2].flatten().tolist())))
             for m in layers]  # fmt: skip
    with torch.inference_mode():
        runner.model(inputs.input_ids, inputs.positions, inputs.attn)
    for hook in hooks:
        hook.remove()
    want = native_layers(llm, inputs, len(runner.model.model.layers))
    poisoned = 0
    for moe, used in zip(layers, chosen):
        for e in set(range(len(moe.experts.down_proj))) - used:
            for linear in (moe.experts.gate_up_proj[e], moe.experts.down_proj[e]):
                for w in parts(linear.blocks):
                    w.scales.fill_(float("nan"))
                    poisoned += 1
    assert poisoned, "every expert chosen: nothing to show"
    got = native_layers(llm, inputs, len(runner.model.model.layers))
    assert torch.equal(got, want)


def test_generation_takes_the_native_steps_and_the_same_tokens(files, monkeypatch):
    path = str(files.get("q4_0", files["q8_0"]))
    llm = LLM(path, dtype="bfloat16", num_kv_blocks=64, max_num_seqs=4, enable_prefix_caching=False)
    runner = llm.llm_engine.model_runner
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    calls, native = [], runner.cpu_decoder.__call__
    monkeypatch.setattr(runner, "cpu_decoder", lambda *a: calls.append(len(a[0])) or native(*a))
    got = llm.generate(prompts, params, use_tqdm=False)
    assert calls and max(calls) == len(PROMPTS)  # decode steps of the whole batch ran natively
    monkeypatch.setattr(runner, "cpu_decoder", None)
    want = llm.generate(prompts, params, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids


def test_bf16_steps_are_bit_identical(files):
    llm = LLM(str(files.get("q4_0", files["q8_0"])), dtype="bfloat16", num_kv_blocks=16)
    runner = llm.llm_engine.model_runner
    inputs = decode_inputs(llm, PROMPTS)
    with torch.inference_mode():
        want = runner.model(inputs.input_ids, inputs.positions, inputs.attn)
        got = runner.cpu_decoder(inputs.input_ids, inputs.positions, inputs.attn)
    assert torch.equal(got, want)
