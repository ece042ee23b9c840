"""Gemma 2, Gemma 3 and Phi-3 as llama.cpp's own `convert_hf_to_gguf.py` writes them (F32) and `llama-quantize`
quantizes them (Q8_0), from tiny random checkpoints written by transformers: tiffin's greedy tokens are
llama-server's on the same file (F32 identical, and transformers' on the checkpoint; Q8_0 identical up to near ties,
as test_dense_families_llama_cpp), and transformers' on the file's weights as gguf-py dequantizes them (tiffin's
exact mode).

What the files exercise: Gemma's norms stored as 1 + weight, tied embeddings scaled by sqrt(hidden), GeGLU; Gemma 2's
soft-caps and a window of 8 on every other layer; Gemma 3's q/k norms, five local layers (window 12, RoPE base 100)
to one global (linear RoPE scaling x2), as llama.cpp fixes the pattern; prompts and generations past the windows.
llama.cpp scales queries by head_dim**-0.5 whatever `query_pre_attn_scalar` says (but for the 27B models), so the
checkpoints set it to head_dim. Phi-3: q/k/v and gate/up fused (`attn_qkv`, `ffn_up`: kept quantized whole in Q8_0),
LongRoPE with a pretraining length of 128: llama.cpp and tiffin pick its long factors once for a served context past
it (256), where transformers switches per sequence: its reference is the same weights with the short factors set
to the long ones.

Skipped, saying why, without llama.cpp (see test_dense_families_llama_cpp)."""

import copy

import pytest
import torch
from references import spread_weights
from test_dense_families import TINY, VOCAB, longrope, prompts
from test_dense_families_llama_cpp import LLAMA_CPP, SERVER, assert_answers_as_llama_server
from transformers import AutoConfig, AutoModelForCausalLM

from tiffin.engine.models.gguf_checkpoint import GGUFCheckpoint
from tiffin.engine.models.loader import get_model_config
from tiffin.testing.llama_cpp import convert_hf_to_gguf, run_peer
from tiffin.tiny import write_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

QUANTIZE = LLAMA_CPP / "build" / "bin" / "llama-quantize"
GEMMA = dict(tie_word_embeddings=True)
FAMILIES = {  # model_type -> (its config beyond TINY, spread_weights' arguments)
    "gemma2": (
        GEMMA
        | dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=8, attn_logit_softcapping=5.0)
        | dict(final_logit_softcapping=3.0),
        (0.0, 1, 3.0),  # norms near 0, which Gemma adds to 1
    ),
    "gemma3_text": (
        GEMMA
        | dict(num_hidden_layers=6, head_dim=64, query_pre_attn_scalar=64, sliding_window=12)
        | dict(
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
            }
        ),
        (0.0, 1, 3.0),
    ),
    "phi3": (dict(rope_scaling=longrope(0), original_max_position_embeddings=128), (1.0, 0.5, 2.0)),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def converted(request, tmp_path_factory):
    """(model_type, {outtype: the GGUF llama.cpp wrote}, the transformers reference)."""
    if not (SERVER.exists() and QUANTIZE.exists() and (LLAMA_CPP / "convert_hf_to_gguf.py").exists()):
        pytest.skip(f"no llama.cpp at {LLAMA_CPP} (convert_hf_to_gguf.py, build/bin/llama-server, llama-quantize)")
    model_type, tmp = request.param, tmp_path_factory.mktemp(request.param)
    extra, spread = FAMILIES[model_type]
    config = AutoConfig.for_model(model_type, **(TINY | extra))
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    spread_weights(hf, *spread)
    hf.save_pretrained(tmp / "hf")
    write_tokenizer(tmp / "hf", VOCAB, False, TINY["max_position_embeddings"])
    files = {"f32": tmp / "f32.gguf", "q8_0": tmp / "q8_0.gguf"}
    convert_hf_to_gguf(LLAMA_CPP, tmp / "hf", "f32", files["f32"])
    run_peer([QUANTIZE, files["f32"], files["q8_0"], "Q8_0"])
    if model_type == "phi3":  # the long factors at every length, as a served context past the pretraining length
        rope = config.rope_parameters
        rope["short_factor"] = rope["long_factor"]
        reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        reference.load_state_dict(hf.state_dict())
        hf = reference
    hf.generation_config.eos_token_id = None
    return model_type, files, hf


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_llama_cpp_conversion_answers_as_llama_server(converted, outtype, tmp_path):
    model_type, files, hf = converted
    dequantized = None if outtype == "f32" else dequantized_model(hf, files[outtype])
    assert_answers_as_llama_server(model_type, files, outtype, hf, prompts()[:4], tmp_path, dequantized)


def dequantized_model(hf: torch.nn.Module, path) -> torch.nn.Module:
    """`hf` with the weights of GGUF file `path` as gguf-py dequantizes them, under Hugging Face's names (Gemma's
    norms without the converter's + 1, Phi-3's fused layers as its checkpoint fuses them)."""
    model, weights = copy.deepcopy(hf), dict(GGUFCheckpoint(path).weights({}))
    weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])  # tied
    model.load_state_dict(weights, strict=True)
    return model


def test_config_from_gguf_is_the_checkpoints(converted):
    """The metadata read back: Gemma's windows per layer, soft-caps and local RoPE base; Phi-3's LongRoPE factors,
    and its fused layers kept in their Q8_0 blocks."""
    model_type, files, hf = converted
    config = get_model_config(files["q8_0"])
    head_dim = getattr(hf.config, "head_dim", None) or TINY["hidden_size"] // TINY["num_attention_heads"]  # Phi-3: none
    assert (config.num_layers, config.head_dim) == (hf.config.num_hidden_layers, head_dim)
    if model_type == "phi3":
        ours, theirs = config.rope_scaling, hf.config.rope_parameters
        assert ours["long_factor"] == pytest.approx(theirs["long_factor"], rel=1e-6)
        assert ours["original_max_position_embeddings"] == 128
        kept = config.quant_config.kept
        assert {kept[f"model.layers.0.{m}.weight"] for m in ("self_attn.qkv_proj", "mlp.gate_up_proj")} == {"Q8_0"}
        return
    gemma, window = config.family, hf.config.sliding_window
    assert gemma.windows == tuple(window if t == "sliding_attention" else 0 for t in hf.config.layer_types)
    assert (gemma.attn_softcap, gemma.final_softcap) == (
        hf.config.attn_logit_softcapping or 0.0,
        hf.config.final_logit_softcapping or 0.0,
    )
    if model_type == "gemma3_text":
        assert gemma.rope["sliding_attention"][0] == 100.0
        assert gemma.rope["full_attention"] == (10000.0, {"factor": 2.0, "rope_type": "linear"})
