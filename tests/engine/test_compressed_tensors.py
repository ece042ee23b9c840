"""compressed-tensors checkpoints (written by the package: tests/compressed_checkpoints.py), block-FP8 checkpoints
and `quantization="fp8"`: the stored weights against the format's own dequantization, greedy generation against
transformers holding those dequantized weights, the bytes held, and refusals by name."""

import json
from pathlib import Path

import pytest
import torch
from compressed_checkpoints import QUANTIZED, SCHEMES, write_compressed
from safetensors.torch import load_file, save_file
from test_tp import assert_shards_compute_the_whole_layer
from transformers import AutoModelForCausalLM

from tiffin import LLM, SamplingParams
from tiffin.engine.models.linear import Linear
from tiffin.engine.models.loader import build_model, checkpoint_names, get_model_config
from tiffin.quant.fp8 import quantize_rows
from tiffin.testing.perplexity import heldout_text, perplexity
from tiffin.tiny import make_tiny_model

NEW_TOKENS = 16
PROMPT_LENS = (1, 7, 33)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """Dims whose layers hold several groups and 128 x 128 blocks (and a ragged one: 192 inputs)."""
    return make_tiny_model(tmp_path_factory.mktemp("base"), "llama", hidden_size=128, intermediate_size=192,
                           vocab_size=512, dtype="bfloat16")  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(base, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("compressed")
    made = {name: write_compressed(base, root / name, name) for name in SCHEMES}
    made["fp8-deepseek"] = _write_block_fp8(base, root / "fp8-deepseek", (128, 128))
    return made


def _write_block_fp8(base: Path, out: Path, block: tuple[int, int]) -> Path:
    """DeepSeek-V3's layout: `weight` e4m3 and `weight_scale_inv` float32 a block (which multiplies), its
    dequantized twin in `out / "reference"`; a block's scale its largest magnitude / 448."""
    state, written = load_file(base / "model.safetensors"), {}
    reference = dict(state)
    for key, w in state.items():
        if key.removesuffix(".weight").rsplit(".", 1)[-1] not in QUANTIZED:
            written[key] = w
            continue
        n, k = w.shape
        rows, cols = block
        padded = torch.nn.functional.pad(w.float(), (0, -k % cols, 0, -n % rows))
        blocks = padded.view(padded.shape[0] // rows, rows, -1, cols)
        scale = blocks.abs().amax((1, 3)) / 448
        full = scale.repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]
        codes = (w.float() / full).clamp(-448, 448).to(torch.float8_e4m3fn)
        written[key], written[key.replace(".weight", ".weight_scale_inv")] = codes, scale
        reference[key] = codes.float() * full
    for target in (out, out / "reference"):
        target.mkdir(parents=True, exist_ok=True)
        for f in base.iterdir():
            (target / f.name).write_bytes(f.read_bytes())
    save_file(written, out / "model.safetensors")
    save_file(reference, out / "reference" / "model.safetensors")
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    return out


def _stored_weights(path: Path, backend: str, **config) -> dict[str, torch.Tensor]:
    """Every quantized projection's weight `[out, in]` as the loaded layers hold it, float32."""
    model_config = get_model_config(path, **config)
    model_config.dtype = torch.float32
    model = build_model(model_config, path, torch.device("cpu"), 64, "torch", quant_backend=backend)
    weights = {}
    for name, module in model.named_modules():
        if isinstance(module, Linear) and hasattr(module.method, "dequantize"):
            shards = module.method.dequantize(module).split(module.output_sizes)
            weights.update(zip((ck + ".weight" for ck in checkpoint_names(model.stacked_modules, name)), shards))
    return weights


@pytest.mark.parametrize("name", [*SCHEMES, "fp8-deepseek"])
@pytest.mark.parametrize("backend", ["torch", "native"])
def test_stored_weights_equal_the_formats_dequantization(checkpoints, name, backend):
    """Bit for bit, but for zero points (their `-z * s` held in fp16): there within a bf16 step."""
    reference = load_file(checkpoints[name] / "reference" / "model.safetensors")
    stored = _stored_weights(checkpoints[name], backend)
    assert len(stored) == 7 * 2 and stored.keys() <= reference.keys()
    for key, weight in stored.items():
        want = reference[key]
        if "asym" in name:
            torch.testing.assert_close(weight, want.float(), rtol=2**-8, atol=2**-8 * float(want.abs().max()))
        else:
            assert torch.equal(weight, want), key


def _reference_generate(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
            outs.append(out[0, len(p) :].tolist())
    return outs


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _generate(path: Path, prompts, **settings) -> list[list[int]]:
    llm = LLM(str(path), dtype="float32", num_kv_blocks=16, **settings)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                          use_tqdm=False)]  # fmt: skip


@pytest.mark.parametrize("name", [*SCHEMES, "fp8-deepseek"])
def test_greedy_matches_transformers_on_the_dequantized_weights(checkpoints, name):
    path, prompts = checkpoints[name], _prompts(len(name))
    expected = _reference_generate(path / "reference", prompts)
    assert _generate(path, prompts, cpu_quant_compute="exact") == expected


@pytest.mark.parametrize("name", [*SCHEMES, "fp8-deepseek"])
def test_weights_held(checkpoints, name):
    """The blocks replace the checkpoint's tensors: 4-bit layers <= 0.33x their bf16 bytes, 8-bit and FP8 <= 0.57x
    (8.5 bits a weight for int8 blocks, 9 for FP8's fp32 scales); the engine counts them."""
    llm = LLM(str(checkpoints[name]), dtype="bfloat16", num_kv_blocks=8)
    model = llm.llm_engine.model_runner.model
    layers = [m for m in model.modules() if isinstance(m, Linear) and getattr(m, "blocks", None) is not None]
    assert len(layers) == 4 * 2 and all(not hasattr(m, "weight_packed") and not hasattr(m, "weight") for m in layers)
    held = sum(p.nbytes for m in layers for p in m.parameters())
    bf16 = sum(2 * m.input_size * m.output_size for m in layers)
    assert held <= (0.33 if "w4" in name else 0.57) * bf16, held / bf16
    assert llm.llm_engine.stats().weight_bytes == sum(p.nbytes for p in model.parameters())


@pytest.mark.parametrize("name", ["w4a16-g64", "w8a8-int", "fp8-channel", "fp8-deepseek"])
def test_native_perplexity_is_within_0_3_percent_of_exact(checkpoints, name):
    ppl = {}
    for mode in ("exact", "native", "int8"):
        llm = LLM(str(checkpoints[name]), dtype="float32", cpu_quant_compute=mode, num_kv_blocks=40)
        ids = llm.get_tokenizer().encode(heldout_text(), add_special_tokens=False)[:6000]
        ppl[mode] = perplexity(llm, ids)
    for mode in ("native", "int8"):
        assert abs(ppl[mode] / ppl["exact"] - 1) < 0.003, ppl


@pytest.mark.parametrize("name", ["w4a16-g64", "w4a16-asym-channel", "w8a8-int", "fp8-block", "fp8-deepseek"])
def test_tensor_parallel_shards_compute_the_whole_layer(checkpoints, name):
    """Groups, zero points and FP8 blocks split with their rows and inputs (o_proj's 64 inputs a rank: half a 128 x
    128 block)."""
    assert_shards_compute_the_whole_layer(checkpoints[name])


def test_quantization_fp8_at_load_matches_the_rounded_model(base, tmp_path):
    """`quantization="fp8"`: each linear weight rounded to FP8 a scale per output channel (`quantize_rows`), bit for
    bit; greedy equal to transformers on that rounded model."""
    state = load_file(base / "model.safetensors")
    rounded = dict(state)
    for key, w in state.items():
        if key.removesuffix(".weight").rsplit(".", 1)[-1] in QUANTIZED:
            codes, scale = quantize_rows(w)
            rounded[key] = codes.float() * scale
    stored = _stored_weights(base, "torch", quantization="fp8")
    assert len(stored) == 14 and all(torch.equal(w, rounded[k]) for k, w in stored.items())
    reference = tmp_path / "rounded"
    reference.mkdir()
    for f in base.iterdir():
        (reference / f.name).write_bytes(f.read_bytes())
    save_file(rounded, reference / "model.safetensors")
    prompts = _prompts(3)
    assert _generate(base, prompts, quantization="fp8", cpu_quant_compute="exact") == _reference_generate(
        reference, prompts
    )


def test_quantization_setting_refusals(base, checkpoints):
    with pytest.raises(ValueError, match="quantization 'int3' is not supported"):
        get_model_config(base, quantization="int3")
    with pytest.raises(ValueError, match="quantized with 'compressed-tensors'"):
        get_model_config(checkpoints["fp8-channel"], quantization="fp8")
    with pytest.raises(ValueError, match="applies to checkpoints quantized with it"):
        get_model_config(base, quantization="awq")
    assert get_model_config(checkpoints["fp8-deepseek"], quantization="fp8").quant_config.block == (128, 128)


@pytest.mark.parametrize(
    "change, named",
    [
        ({"sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity_config"),
        ({"kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme"),
        ({"weights": {"num_bits": 2}}, "2-bit int weights"),
        ({"weights": {"actorder": "group"}}, "actorder 'group'"),
        ({"weights": {"strategy": "tensor_group"}}, "weight strategy 'tensor_group'"),
        ({"output_activations": {"num_bits": 8}}, "quantized output activations"),
        ({"format": "marlin-24"}, "format 'marlin-24'"),
    ],
)
def test_unsupported_variants_are_refused_by_name(checkpoints, tmp_path, change, named):
    config = json.loads((checkpoints["w4a16-g64"] / "config.json").read_text())
    quant, group = config["quantization_config"], config["quantization_config"]["config_groups"]["group_0"]
    for key, value in change.items():
        if key in ("weights", "output_activations"):
            group[key] = {**(group.get(key) or {}), **value}
        else:
            quant[key] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=named):
        get_model_config(tmp_path)


def test_a_missing_tensor_is_named(checkpoints, tmp_path):
    path = checkpoints["w8a8-int"]
    for f in path.iterdir():
        if f.is_file():
            (tmp_path / f.name).write_bytes(f.read_bytes())
    state = load_file(path / "model.safetensors")
    del state["model.layers.1.self_attn.k_proj.weight_scale"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks tensors of shard\(s\) \[1\]"):
        LLM(str(tmp_path), num_kv_blocks=8)


def test_fp32_scales_are_held_in_fp16_and_said_so(tmp_path, caplog):
    """A float32 checkpoint's integer-weight scales (llm-compressor writes them in the model's dtype) round to the
    blocks' fp16: each weight within 2^-11 of its size, and the load says so."""
    from tiffin.quant import compressed_tensors

    base = make_tiny_model(tmp_path / "base", "llama", hidden_size=128, intermediate_size=192, dtype="float32")
    path = write_compressed(base, tmp_path / "w8a8", "w8a8-int")
    compressed_tensors._warn_once.cache_clear()
    with caplog.at_level("WARNING", logger="tiffin.quant.compressed_tensors"):
        stored = _stored_weights(path, "torch")
    assert "torch.float32 weight scales are held in fp16, rounded to 2^-12 of their size" in caplog.text
    reference = load_file(path / "reference" / "model.safetensors")
    for key, weight in stored.items():
        torch.testing.assert_close(weight, reference[key], rtol=2**-11, atol=0)
        assert not torch.equal(weight, reference[key])  # rounded, as said
