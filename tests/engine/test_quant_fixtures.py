"""Real AutoAWQ and GPTQModel checkpoints (tests/fixtures/quant, written by the tools through `tiffin quantize`;
see regenerate.py there): tiffin's unpacking equals each tool's own dequantization bit for bit, greedy
generation at float32 equals a transformers model holding those dequantized weights (tokens identical,
per-step logprobs within 1e-3), and 4-bit layers take <= 0.3x of their fp16 size. (The Triton kernel on
these layers: test_quant_kernels.py.)"""

import json
from pathlib import Path

import pytest
import torch
from references import reference_generate
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from tiffin import LLM, SamplingParams
from tiffin.engine.models.linear import Linear
from tiffin.engine.models.loader import build_model, checkpoint_names, get_model_config
from tiffin.testing.perplexity import heldout_text, perplexity

FIXTURES = Path(__file__).parents[1] / "fixtures" / "quant"
REFERENCE = "reference/dequantized.safetensors"  # each tool's own dequantized weights [out, in]
NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / REFERENCE).exists())
QUANT_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")
NEW_TOKENS = 24
PROMPT_LENS = (1, 6, 19, 40)


def test_every_fixture_is_present():
    assert set(NAMES) == {
        "awq-g64",
        "awq-g32-skip-o_proj",
        "gptq-4bit-g64-actorder-sym",
        "gptq-8bit-perchannel-sym",
        "gptq-4bit-g32-asym",
        "gptq-4bit-g128-actorder-asym-v2",
    }


def load_tiffin_model(path: Path, kernel_backend: str = "torch"):
    config = get_model_config(path)
    config.dtype = torch.float32
    return build_model(config, path, torch.device("cpu"), 64, kernel_backend)


@pytest.mark.parametrize("name", NAMES)
def test_unpacking_equals_the_tools_dequantization(name):
    path = FIXTURES / name
    reference = load_file(path / REFERENCE)
    model = load_tiffin_model(path)
    seen = set()
    with safe_open(path / "model.safetensors", framework="pt") as ckpt:
        for module_name, module in model.named_modules():
            if not isinstance(module, Linear):
                continue
            names = checkpoint_names(model.stacked_modules, module_name)
            if not hasattr(module.method, "dequantize"):  # left unquantized (modules_to_not_convert)
                # its weight as the layer applies it (it may be prepacked): x = I picks each weight out exactly
                weight = module.method.apply(module, torch.eye(module.input_size)).T
                for shard, ck in zip(weight.split(module.output_sizes), names):
                    assert torch.equal(shard, ckpt.get_tensor(ck + ".weight").float()), ck
                    assert ck + ".weight" not in reference
                continue
            weight = module.method.dequantize(module)
            assert weight.dtype == torch.float16
            for shard, ck in zip(weight.split(module.output_sizes), names):
                assert torch.equal(shard, reference[ck + ".weight"]), f"{ck} differs from the tool's dequantization"
                seen.add(ck + ".weight")
    assert seen == set(reference)
    if "skip" in name:
        assert not any("o_proj" in key for key in seen) and len(seen) == 12


def reference_model(path: Path):
    """transformers float32 model: the checkpoint's unquantized tensors plus the tool's dequantized weights."""
    raw = json.loads((path / "config.json").read_text())
    raw.pop("quantization_config")
    config = AutoConfig.for_model(**raw)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v.float() for k, v in load_file(path / REFERENCE).items()}
    state.update(
        {k: v.float() for k, v in load_file(path / "model.safetensors").items() if not k.endswith(QUANT_SUFFIXES)}
    )
    hf.load_state_dict(state, strict=True)
    hf.generation_config.eos_token_id = None
    return hf.eval()


@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_transformers_with_the_tools_weights(name):
    path = FIXTURES / name
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(len(name))
    prompts = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
    with torch.inference_mode():
        hf = reference_model(path)
        expected = [reference_generate(hf, p, NEW_TOKENS) for p in prompts]
    llm = LLM(str(path), dtype="float32", kernel_backend="torch", cpu_quant_compute="exact")
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out, (tokens, logprobs) in zip(prompts, outs, expected):
        got = out.outputs[0]
        assert got.token_ids == tokens, f"prompt of {len(prompt)} tokens"
        got_lp = [step[t].logprob for step, t in zip(got.logprobs, got.token_ids)]
        assert max(abs(a - b) for a, b in zip(got_lp, logprobs)) < 1e-3


@pytest.mark.parametrize("name", [n for n in NAMES if "8bit" not in n])
def test_weight_memory(name):
    """4-bit linears (packed weights, zeros, scales, act-order perm) <= 0.3x their fp16 size; the engine
    reports the model's weight bytes."""
    path = FIXTURES / name
    llm = LLM(str(path), dtype="float16", kernel_backend="torch", num_kv_blocks=8, cpu_quant_compute="exact")
    engine = llm.llm_engine
    model = engine.model_runner.model
    quant_bytes = fp16_bytes = 0
    for module in model.modules():
        if isinstance(module, Linear) and hasattr(module.method, "dequantize"):
            quant_bytes += sum(p.nbytes for p in module.parameters())
            fp16_bytes += 2 * module.input_size * module.output_size
    assert 0 < quant_bytes <= 0.3 * fp16_bytes, quant_bytes / fp16_bytes
    assert engine.stats().weight_bytes == sum(p.nbytes for p in model.parameters())
    plain = sum(2 * v.numel() for v in load_file(path / REFERENCE).values()) + sum(
        v.numel() * 2 for k, v in load_file(path / "model.safetensors").items() if not k.endswith(QUANT_SUFFIXES)
    )
    assert engine.stats().weight_bytes < plain


@pytest.mark.parametrize("name", NAMES)
def test_native_and_int8_perplexity_is_within_0_3_percent_of_exact(name):
    """The native kernels (activations at 15 bits, or bf16 dot products for prompt-sized inputs) and llama.cpp's
    int8 scheme against the exact path on 20,000 tokens of held-out prose; the repacked 4-bit linears hold at most
    0.35x the bytes of bf16."""
    results = {}
    for mode in ("exact", "native", "int8"):
        llm = LLM(str(FIXTURES / name), dtype="float32", cpu_quant_compute=mode, num_kv_blocks=40)
        ids = llm.get_tokenizer().encode(heldout_text(), add_special_tokens=False)[:20000]
        results[mode] = perplexity(llm, ids)
        if mode != "exact":
            layers = [m for m in llm.llm_engine.model_runner.model.modules() if getattr(m, "blocks", None) is not None]
            assert layers and all(not hasattr(m, "qweight") for m in layers)  # repacked, the checkpoint's copy gone
            bf16 = sum(2 * m.input_size * m.output_size for m in layers)
            share = 0.57 if "8bit" in name else 0.35  # 9 and 5 bits a weight, padding aside
            assert sum(p.nbytes for m in layers for p in m.parameters()) <= share * bf16
    for mode in ("native", "int8"):
        assert abs(results[mode] / results["exact"] - 1) < 0.003, results
