"""Quantization detection: the three places a checkpoint states it, the supported variants, and a refusal
naming the variant for everything else (also when the engine loads such a checkpoint)."""

import json

import pytest

from tiffin import LLM
from tiffin.engine.models.llama import LlamaForCausalLM
from tiffin.engine.models.loader import get_linear_method
from tiffin.quant import AWQConfig, GPTQConfig, UnquantizedLinearMethod, get_quant_config

AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}


def detect(tmp_path, quantization_config=None, files=None):
    raw = {} if quantization_config is None else {"quantization_config": quantization_config}
    for name, content in (files or {}).items():
        (tmp_path / name).write_text(json.dumps(content))
    return get_quant_config(tmp_path, raw)


def test_plain_checkpoint(tmp_path):
    assert detect(tmp_path) is None


def test_config_json_wins_over_side_files(tmp_path):
    got = detect(tmp_path, AWQ, {"quantize_config.json": GPTQ})
    assert got == AWQConfig(group_size=128)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_awq_gemm(tmp_path, group_size):
    got = detect(
        tmp_path, {**AWQ, "group_size": group_size, "version": "GEMM", "modules_to_not_convert": ["visual", "o_proj"]}
    )
    assert got == AWQConfig(group_size, ("visual", "o_proj"))
    assert got.skips("model.layers.3.self_attn.o_proj") and not got.skips("model.layers.3.self_attn.q_proj")


def test_autoawq_quant_config_json(tmp_path):
    """Older AutoAWQ checkpoints: quant_config.json with w_bit / q_group_size and no quant_method."""
    got = detect(
        tmp_path, files={"quant_config.json": {"zero_point": True, "q_group_size": 64, "w_bit": 4, "version": "GEMM"}}
    )
    assert got == AWQConfig(64)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
def test_gptq_variants(tmp_path, bits, group_size):
    got = detect(
        tmp_path,
        {
            **GPTQ,
            "bits": bits,
            "group_size": group_size,
            "desc_act": True,
            "sym": False,
            "checkpoint_format": "gptq_v2",
        },
    )
    assert got == GPTQConfig(bits, group_size, desc_act=True, sym=False, checkpoint_format="gptq_v2")
    assert got.zero_offset == 0


def test_autogptq_quantize_config_json(tmp_path):
    """AutoGPTQ's quantize_config.json, no quant_method and no checkpoint_format: GPTQ v1 (zeros minus one)."""
    got = detect(tmp_path, files={"quantize_config.json": {"bits": 4, "group_size": 128, "desc_act": True}})
    assert got == GPTQConfig(4, 128, desc_act=True, sym=True, checkpoint_format="gptq")
    assert got.zero_offset == 1


@pytest.mark.parametrize(
    "config, variant",
    [
        ({**AWQ, "version": "gemv"}, "version 'gemv'"),
        ({**AWQ, "version": "gemv_fast"}, "version 'gemv_fast'"),
        ({**AWQ, "version": "marlin"}, "version 'marlin'"),
        ({**AWQ, "bits": 8}, "8-bit"),
        ({**AWQ, "zero_point": False}, "zero_point false"),
        ({**AWQ, "group_size": 256}, "group size 256"),
        ({**GPTQ, "bits": 3}, "3-bit"),
        ({**GPTQ, "bits": 2}, "2-bit"),
        ({**GPTQ, "group_size": 16}, "group size 16"),
        ({**GPTQ, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
        ({**GPTQ, "format": "bitblas"}, "checkpoint_format 'bitblas'"),
        ({**GPTQ, "pack_dtype": "int16"}, "pack_dtype 'int16'"),
        ({**GPTQ, "lm_head": True}, "quantized lm_head"),
        ({"quant_method": "bitnet"}, "method 'bitnet'"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "method 'bitsandbytes'"),
    ],
)
def test_unsupported_variants_are_named(tmp_path, config, variant):
    with pytest.raises(ValueError, match="tiffin serves AWQ") as err:
        detect(tmp_path, config)
    assert variant in str(err.value)


def test_fused_layer_must_be_all_or_nothing():
    def method(skip: tuple[str, ...], prefix: str):
        return get_linear_method(AWQConfig(64, skip), LlamaForCausalLM.stacked_modules, prefix, "torch")

    with pytest.raises(ValueError, match="some of"):
        method(("q_proj",), "model.layers.0.self_attn.qkv_proj")
    assert not isinstance(method(("q_proj",), "model.layers.0.self_attn.o_proj"), UnquantizedLinearMethod)
    assert isinstance(method(("self_attn",), "model.layers.0.self_attn.qkv_proj"), UnquantizedLinearMethod)


def test_engine_refuses_unsupported_checkpoint(tiny_model, tmp_path):
    """The refusal comes from loading, before any weight is read."""
    src = tiny_model("llama")
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {**AWQ, "version": "gemv_fast"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="AWQ with version 'gemv_fast' is not supported"):
        LLM(str(tmp_path), dtype="float32")


def test_act_order_fused_layer_loads_onto_another_device():
    """Defect seen on CUDA: the second shard's g_idx was compared with the device copy of the first. Module
    tensors on `meta` stand in for a GPU: any read of their values, or any op mixing them with the host
    checkpoint tensors, fails there as it fails across CUDA and CPU."""
    import torch

    from tiffin.engine.models.linear import Linear

    k, group = 128, 32
    g_idx = torch.randperm(k) % (k // group)
    method = GPTQConfig(4, group, desc_act=True, sym=True, checkpoint_format="gptq").linear_method("qkv", "torch")
    with torch.device("meta"):
        layer = Linear(k, [64, 32], False, torch.float16, method)
    for shard, n in enumerate(layer.output_sizes):
        layer.load("qweight", torch.zeros(k // 8, n, dtype=torch.int32), shard)
        layer.load("g_idx", g_idx, shard)
    with pytest.raises(ValueError, match="different act-order g_idx"):
        layer.load("g_idx", g_idx.roll(1), 1)
    method.process_weights_after_loading(layer)
    assert layer.perm.device.type == "meta" and layer.qweight.device.type == "meta"
