"""Mixtures of experts from GGUF: Qwen3-MoE and Mixtral (llama with an expert count) as llama.cpp's own
`convert_hf_to_gguf.py` writes them from test_moe's tiny checkpoints (F32, Q8_0; Q4_0 by `llama-quantize`), the
stacked experts (`ffn_{gate,up,down}_exps`) kept quantized in their blocks, a `Linear` per expert
(`moe.LinearExperts`).

- tiffin's greedy tokens are llama-server's on the same file: F32 identical (and transformers' on the checkpoint).
  Q8_0: identical to transformers' on the file's weights as gguf-py dequantizes them (the exact path), and to
  llama-server's up to a step where either side's two best tokens are within NEAR_TIE nats (as
  test_dense_families_llama_cpp; llama.cpp quantizes the activations to 8 bits, and a router's near tie flips
  an expert: on Qwen3-MoE all four prompts part from llama-server's, each at such a step).
- Each kept expert computes what its weight as gguf-py dequantizes it computes: exactly on the exact path, to the
  activations' 15-bit quantization on the native block kernels.
- A forward reads only the experts the router chose (a decode step of one token, a batch of three): the stacked
  experts' bytes touched by every tensor op (a Hugging Face checkpoint's `Experts`), the per-expert layers called
  (a GGUF file's `LinearExperts`).

Skipped, saying why, without llama.cpp (see test_dense_families_llama_cpp)."""

import copy

import gguf
import numpy as np
import pytest
import torch
from references import reference_generate
from test_dense_families_llama_cpp import LLAMA_CPP, SERVER, TOKENS, assert_answers_as_llama_server
from test_moe import ARCHS, TINY, VOCAB, prompts, randomize
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM

from tiffin import LLM, SamplingParams
from tiffin.engine.models.gguf_checkpoint import GGUFCheckpoint
from tiffin.engine.models.loader import build_model, get_model_config
from tiffin.engine.models.moe import Experts, LinearExperts
from tiffin.testing.llama_cpp import convert_hf_to_gguf, run_peer
from tiffin.tiny import write_tokenizer

QUANTIZE = LLAMA_CPP / "build" / "bin" / "llama-quantize"
FILES = ("f32", "q8_0", "q4_0")


def convert(model_type: str, extra: dict, tmp, outtypes=("f32", "q8_0")) -> tuple[dict, torch.nn.Module]:
    """({file type: the GGUF llama.cpp's converter wrote}, the transformers model) of a tiny random checkpoint."""
    if not (SERVER.exists() and QUANTIZE.exists() and (LLAMA_CPP / "convert_hf_to_gguf.py").exists()):
        pytest.skip(f"no llama.cpp at {LLAMA_CPP} (convert_hf_to_gguf.py, build/bin/llama-server, llama-quantize)")
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **TINY, **extra))
    randomize(hf.float().eval())
    with torch.no_grad():  # logits 3x as far apart: fewer near ties for Q8_0's rounding to flip
        hf.lm_head.weight.mul_(3.0)
    hf.save_pretrained(tmp / "hf")
    write_tokenizer(tmp / "hf", VOCAB, model_type.startswith("qwen"), TINY["max_position_embeddings"])
    hf.generation_config.eos_token_id = None
    files = {outtype: tmp / f"{outtype}.gguf" for outtype in FILES}
    for outtype in outtypes:
        convert_hf_to_gguf(LLAMA_CPP, tmp / "hf", outtype, files[outtype])
    return files, hf


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def converted(request, tmp_path_factory):
    """(model_type, {file type: the GGUF llama.cpp wrote}, the transformers model, its checkpoint's path)."""
    model_type, tmp = request.param, tmp_path_factory.mktemp(request.param)
    files, hf = convert(model_type, ARCHS[model_type], tmp)
    run_peer([QUANTIZE, files["f32"], files["q4_0"], "Q4_0"])
    return model_type, files, hf, tmp / "hf"


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_llama_cpp_conversion_answers_as_llama_server(converted, outtype, tmp_path):
    model_type, files, hf, _ = converted
    dequantized = None if outtype == "f32" else dequantized_model(hf, files[outtype])
    assert_answers_as_llama_server(model_type, files, outtype, hf, prompts()[:4], tmp_path, dequantized, False)


def dequantized_model(hf: torch.nn.Module, path) -> torch.nn.Module:
    """`hf` with the weights of GGUF file `path`, dequantized by gguf-py (named and q/k rows ordered as
    Hugging Face's by `GGUFCheckpoint`), the experts fused as transformers holds them."""
    model, checkpoint = copy.deepcopy(hf), GGUFCheckpoint(path)
    weights = dict(checkpoint.weights({}))
    for name in [n for n in weights if ".experts.gate_proj." in n]:
        up = weights.pop(name.replace("gate_proj", "up_proj"))
        weights[name.replace("gate_proj.weight", "gate_up_proj")] = torch.cat([weights.pop(name), up], dim=1)
        down = name.replace("gate_proj", "down_proj")
        weights[down.removesuffix(".weight")] = weights.pop(down)
    if hf.config.tie_word_embeddings is False and "lm_head.weight" not in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    model.load_state_dict(weights, strict=True)
    return model


@pytest.mark.slow
@pytest.mark.subprocess
def test_qwen2_moe_shared_expert_from_gguf_matches_transformers(tmp_path):
    """qwen2moe: the shared expert and its gate (`ffn_*_shexp`, `ffn_gate_inp_shexp`), top-k weights not
    renormalized; every layer sparse (llama.cpp's converter writes no dense layers)."""
    extra = {k: v for k, v in ARCHS["qwen2_moe"].items() if k != "mlp_only_layers"}
    files, hf = convert("qwen2_moe", extra, tmp_path, ("f32",))
    llm = LLM(str(files["f32"]), dtype="float32", max_model_len=256)
    assert llm.llm_engine.model_config.moe.shared_expert_size == extra["shared_expert_intermediate_size"]
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()[:3]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [reference_generate(hf, p, TOKENS)[0] for p in prompts()[:3]]


def dequantized_experts(path, layer: int) -> dict[str, torch.Tensor]:
    """gate/up/down of layer `layer`'s experts `[E, out, in]`, as gguf-py reads and dequantizes the file."""
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    out = {}
    for name in ("gate", "up", "down"):
        t = tensors[f"blk.{layer}.ffn_{name}_exps.weight"]
        assert t.tensor_type != gguf.GGMLQuantizationType.F32 or path.stem == "f32"
        out[name] = torch.from_numpy(np.array(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32))
    return out


@pytest.mark.parametrize("outtype", ["q8_0", "q4_0"])
@pytest.mark.parametrize("quant_backend, tolerance", [("torch", 1e-5), ("native", 2e-3)], ids=["exact", "native"])
def test_kept_experts_compute_their_dequantized_weights(converted, outtype, quant_backend, tolerance):
    _, files, _, _ = converted
    path = files[outtype]
    model = build_model(get_model_config(path), path, "cpu", 64, "torch", quant_backend=quant_backend)
    moe = model.model.layers[1].mlp
    assert isinstance(moe.experts, LinearExperts)
    linears = [*moe.experts.gate_up_proj, *moe.experts.down_proj]
    kept = [getattr(x, "blocks", None) is not None or getattr(x, "qweight", None) is not None for x in linears]
    assert all(kept), "an expert dequantized at load"
    w = dequantized_experts(path, 1)
    x = torch.randn(5, TINY["hidden_size"], generator=torch.Generator().manual_seed(2))
    weights, experts = moe.route(x)
    with torch.inference_mode():
        got = moe.experts(x, weights, experts)
    expected = torch.zeros_like(x)
    for t in range(len(x)):
        for weight, e in zip(weights[t], experts[t].tolist()):
            h = torch.nn.functional.silu(w["gate"][e] @ x[t]) * (w["up"][e] @ x[t])
            expected[t] += weight * (w["down"][e] @ h)
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())


class BytesRead(TorchDispatchMode):
    """The (storage pointer, start byte, end byte) of every strided tensor an op reads (a view reads none; a weight
    prepacked for oneDNN, as the router's may be where fp32 linears run on it, has no storage to point at)."""

    def __init__(self):
        super().__init__()
        self.read = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for a in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(a, torch.Tensor) and a.layout == torch.strided and a.numel() and not func.is_view:
                start = a.storage_offset() * a.element_size()
                end = start + (1 + sum((n - 1) * s for n, s in zip(a.shape, a.stride()))) * a.element_size()
                self.read.append((a.untyped_storage().data_ptr(), start, end))
        return func(*args, **(kwargs or {}))


def stacked_experts_read(experts: Experts, read: list[tuple[int, int, int]]) -> set[int]:
    """The experts of whose stacked `gate_up_proj` / `down_proj` rows any byte was read."""
    touched = set()
    for stacked in (experts.gate_up_proj, experts.down_proj):
        ptr, per_expert = stacked.untyped_storage().data_ptr(), stacked[0].numel() * stacked.element_size()
        for p, start, end in read:
            if p == ptr:
                touched |= set(range(start // per_expert, (end - 1) // per_expert + 1))
    return touched


@pytest.mark.parametrize("tokens", [1, 3])
def test_a_forward_reads_only_the_chosen_experts(converted, tokens):
    model_type, files, _, hf_path = converted
    x = torch.randn(tokens, TINY["hidden_size"], generator=torch.Generator().manual_seed(3))
    layers = {
        "safetensors": build_model(get_model_config(hf_path), hf_path, "cpu", 64, "torch").model.layers[0].mlp,
        "gguf": build_model(get_model_config(files["q8_0"]), files["q8_0"], "cpu", 64, "torch").model.layers[0].mlp,
    }
    for source, moe in layers.items():
        chosen = set(moe.route(x)[1].flatten().tolist())
        num_experts = ARCHS[model_type].get("num_experts") or ARCHS[model_type]["num_local_experts"]
        assert len(chosen) < num_experts
        if source == "safetensors":
            assert isinstance(moe.experts, Experts)
            with torch.inference_mode(), BytesRead() as mode:
                moe(x)
            assert stacked_experts_read(moe.experts, mode.read) == chosen
            continue
        calls = []
        for e, (gate_up, down) in enumerate(zip(moe.experts.gate_up_proj, moe.experts.down_proj)):
            for linear in (gate_up, down):
                linear.register_forward_hook(lambda module, args, out, e=e, record=calls.append: record(e))
        with torch.inference_mode():
            moe(x)
        assert sorted(calls) == sorted(2 * list(chosen)), "each chosen expert's gate_up and down, once"
