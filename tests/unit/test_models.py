"""The model registry and shared layers: what each architecture implies beyond its config.json, refusals that
name what tiffin serves, the activation table against transformers', and a quant format registered by name."""

import json
from dataclasses import dataclass

import pytest
import torch
from transformers.activations import ACT2FN

from tiffin.engine.models.layers import ACTIVATIONS
from tiffin.engine.models.loader import get_model_config
from tiffin.engine.models.registry import ARCHITECTURES
from tiffin.quant import QUANT_CONFIGS, QuantizationConfig, UnquantizedLinearMethod, get_quant_config
from tiffin.tiny import make_config


def write_config(tmp_path, arch="llama", **overrides):
    (tmp_path / "config.json").write_text(json.dumps({**make_config(arch), **overrides}))
    return tmp_path


@pytest.mark.parametrize(
    "arch, qkv_bias, qk_norm",
    [("llama", False, False), ("mistral", False, False), ("qwen2", True, False), ("qwen3", False, True)],
)
def test_architecture_facts(tmp_path, arch, qkv_bias, qk_norm):
    config = get_model_config(write_config(tmp_path, arch))
    assert (config.qkv_bias, config.qk_norm, config.hidden_act) == (qkv_bias, qk_norm, "silu")
    assert config.architecture in ARCHITECTURES and config.quant_config is None


def test_unsupported_architecture_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'; tiffin serves LlamaForCausalLM"):
        get_model_config(write_config(tmp_path, architectures=["GPT2LMHeadModel"]))


def test_unsupported_activation_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unsupported hidden_act 'relu2'; tiffin serves silu, gelu"):
        get_model_config(write_config(tmp_path, hidden_act="relu2"))


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activations_match_transformers(name):
    gate_up = torch.randn(5, 2, 64, generator=torch.Generator().manual_seed(0))
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ACTIVATIONS[name](gate_up), ACT2FN[name](gate) * up, rtol=0, atol=1e-6)


@dataclass(frozen=True)
class ToyConfig(QuantizationConfig):
    bits: int

    name = "toy"
    description = "Toy (3-bit)"

    @classmethod
    def from_config(cls, settings: dict, source: str) -> "ToyConfig":
        return cls(settings["bits"])

    def linear_method(self, prefix: str, backend: str) -> UnquantizedLinearMethod:
        return UnquantizedLinearMethod()


def test_a_registered_quant_format_is_detected_and_named(tmp_path, monkeypatch):
    monkeypatch.setitem(QUANT_CONFIGS, ToyConfig.name, ToyConfig)
    assert get_quant_config(tmp_path, {"quantization_config": {"quant_method": "toy", "bits": 3}}) == ToyConfig(3)
    with pytest.raises(ValueError, match=r"method 'bitnet' is not supported; tiffin serves AWQ .* and Toy \(3-bit\)"):
        get_quant_config(tmp_path, {"quantization_config": {"quant_method": "bitnet"}})


@pytest.mark.parametrize(
    "dtype, fp32_gemm",
    [(torch.float32, "mkl"), (torch.float32, "onednn"), (torch.bfloat16, "auto")],
    ids=["fp32-mkl", "fp32-onednn", "bf16"],
)
def test_plain_linear_and_embedding_on_cpu_match_torch(dtype, fp32_gemm, monkeypatch):
    """Weights prepacked for oneDNN (bf16; fp32 where it is the faster) free the plain copy, but an embedding
    keeps it for lookups; fp32 ones left to MKL are stored column-major: each computes torch's `linear` /
    `embedding`."""
    monkeypatch.setenv("TIFFIN_CPU_FP32_GEMM", fp32_gemm)
    from tiffin.engine.models.linear import Embedding, Linear

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=gen).to(dtype)
    x = torch.randn(5, 64, generator=gen).to(dtype)
    layer = Linear(64, [32, 64], False, dtype, UnquantizedLinearMethod())  # two stacked shards
    layer.load("weight", weight[:32], 0)
    layer.load("weight", weight[32:], 1)
    embedding = Embedding(96, 64, dtype, UnquantizedLinearMethod())
    embedding.load("weight", weight, None)
    for module in (layer, embedding):
        module.method.process_weights_after_loading(module)
    exact = dtype == torch.bfloat16  # fp32 GEMMs sum in an order that depends on layout and CPU
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, weight), atol=0 if exact else 1e-5, rtol=0)
    torch.testing.assert_close(
        embedding.logits(x), torch.nn.functional.linear(x, weight), atol=0 if exact else 1e-5, rtol=0
    )
    assert torch.equal(embedding(torch.tensor([3, 95])), weight[[3, 95]])
    # bf16 prepacked where oneDNN computes in bf16 (AVX-512 BF16 or AMX; not on an AVX2-only CPU)
    prepacked = torch.ops.mkldnn._is_mkldnn_bf16_supported() if dtype == torch.bfloat16 else fp32_gemm == "onednn"
    assert (layer.packed_weight is not None) == prepacked
    assert layer.weight.numel() == (0 if prepacked else 96 * 64)
