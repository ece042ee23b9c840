"""GGUF files: kept-quantized Q4_0 / Q4_1 / Q8_0 layers against dequantize-then-matmul (torch path exact, Triton
under the interpreter), files written by the `gguf` package's writer for each architecture against
transformers' own GGUF load, and refusals."""

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf_files import K_QUANT_MIX, K_SHAPES, LOW_BIT_MIX, write_gguf

from tiffin.engine.models.gguf_checkpoint import GGUFCheckpoint
from tiffin.engine.models.linear import Linear
from tiffin.kernels.triton_quant import _compile_gguf, quant_tile
from tiffin.quant.gguf import FIELD_TYPES, GGUFLinearMethod

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}  # relative to the output's scale


def fused_layer(qtype: QType, k: int, sizes: list[int], backend: str, seed: int) -> tuple[Linear, torch.Tensor]:
    """A GGUF-kept layer stacking one shard per entry of `sizes`, and the gguf package's dequantized weight."""
    g = np.random.default_rng(seed)
    weight = (g.standard_normal((sum(sizes), k)) * 0.05).astype(np.float32)
    blocks = gguf.quantize(weight, qtype)
    layer = Linear(k, sizes, False, torch.float32, GGUFLinearMethod([qtype] * len(sizes), backend))
    start = 0
    for shard, size in enumerate(sizes):
        layer.load("weight", torch.from_numpy(blocks[start : start + size].copy()), shard)
        start += size
    return layer, torch.from_numpy(gguf.dequantize(blocks, qtype))


@pytest.mark.parametrize("qtype", list(FIELD_TYPES), ids=lambda t: t.name)
def test_kept_layer_equals_dequantize_then_matmul(qtype):
    layer, weight = fused_layer(qtype, 96, [40, 24, 24], "torch", seed=qtype)
    assert torch.equal(layer.method.dequantize(layer), weight)
    ids = torch.tensor([0, 87, 5, 5])
    assert torch.equal(layer.method.embedding(layer, ids), weight[ids])
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(layer(x.to(dtype)), torch.nn.functional.linear(x.to(dtype), weight.to(dtype)))


@pytest.mark.parametrize("qtype", list(FIELD_TYPES), ids=lambda t: t.name)
def test_blocks_at_any_address_load_alike(qtype):
    """A layer copies its blocks' fields out as 16- or 32-bit words; a file's tensor data may start at any offset
    its alignment allows (down to 1), whose words are read from an aligned copy."""
    weight = (np.random.default_rng(1).standard_normal((24, 64)) * 0.05).astype(np.float32)
    blocks = torch.from_numpy(gguf.quantize(weight, qtype))
    shifted = torch.empty(blocks.numel() + 1, dtype=torch.uint8)[1:].view(blocks.shape)
    shifted.copy_(blocks)
    for raw in (blocks, shifted):
        layer = Linear(64, [24], False, torch.float32, GGUFLinearMethod([qtype], "torch"))
        layer.load("weight", raw, None)
        assert torch.equal(layer.method.dequantize(layer), torch.from_numpy(gguf.dequantize(blocks.numpy(), qtype)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("qtype", list(FIELD_TYPES), ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 37, 256])  # 256: the dense path (DENSE_MIN_TOKENS)
def test_triton_kept_layer_matches_dequantize_then_matmul(interpreter, qtype, dtype, m):
    layer, weight = fused_layer(qtype, 128, [48, 40], "triton", seed=m)
    x = torch.randn(m, 128, generator=torch.Generator().manual_seed(m)).to(dtype)
    want = x.double() @ weight.double().T
    got = layer(x)
    assert got.dtype == dtype and got.shape == (m, 88)
    assert (got.double() - want).abs().max().item() / want.abs().max().item() < TOL[dtype]


@pytest.mark.parametrize("arch", [80, 86, 89, 90, 120])
def test_compile_check_covers_every_gguf_tile(arch):
    registered = {
        (c.args[0].dtype, c.kwargs["BITS"], c.kwargs["HAS_MIN"], c.kwargs["BLOCK_M"], c.kwargs["SPLIT"])
        for c in _compile_gguf(arch)
    }
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for m in (1, 16, 17, 32, 33, 4096):
            tile = quant_tile(m, 32, dtype)
            for quant in FIELD_TYPES.values():
                for split in (False, True) if m <= 16 else (False,):
                    assert (dtype, quant.bits, quant.has_min, tile.block_m, split) in registered


def test_tensors_come_out_as_transformers_reads_them(tmp_path, tiny_model):
    """Names mapped, llama q/k rows put back in Hugging Face order, a type not kept (Q5_0) dequantized as
    transformers does."""
    from transformers import AutoModelForCausalLM

    path = write_gguf(tiny_model("mistral"), tmp_path / "m.gguf", QType.Q5_0)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).state_dict()
    weights = dict(GGUFCheckpoint(path).weights(kept={}))
    assert set(weights) == set(reference)
    for name, tensor in weights.items():
        assert torch.equal(tensor, reference[name]), name


@pytest.mark.parametrize("qtype", [QType.F32, QType.F16], ids=lambda t: t.name)
def test_a_big_endian_file_reads_as_a_little_endian_one(tmp_path, tiny_model, qtype):
    def read(big_endian: bool) -> tuple[dict, dict]:
        path = write_gguf(tiny_model("llama"), tmp_path / f"{big_endian}.gguf", qtype, big_endian=big_endian)
        checkpoint = GGUFCheckpoint(path)
        return checkpoint.config({}), dict(checkpoint.weights({}))

    (little_config, little), (big_config, big) = read(False), read(True)
    assert big_config == little_config and big.keys() == little.keys()
    assert all(torch.equal(big[name], little[name]) for name in little)


def test_refusals_name_what_is_unsupported(tmp_path, tiny_model):
    hf = tiny_model("llama")
    with pytest.raises(ValueError, match="GGUF architecture 'minicpm' is not supported"):
        GGUFCheckpoint(write_gguf(hf, tmp_path / "arch.gguf", QType.F32, arch="minicpm"))
    iq2 = np.zeros((4, 66), dtype=np.uint8)  # one IQ2_XXS block per row
    with pytest.raises(ValueError, match=r"GGUF tensor type\(s\) IQ2_XXS not supported"):
        GGUFCheckpoint(write_gguf(hf, tmp_path / "type.gguf", QType.F32, **{"extra.weight": (iq2, QType.IQ2_XXS)}))
    freqs = np.ones(8, dtype=np.float32)
    with pytest.raises(ValueError, match="rope_freqs"):
        GGUFCheckpoint(write_gguf(hf, tmp_path / "freqs.gguf", QType.F32, **{"rope_freqs.weight": (freqs, QType.F32)}))


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_without_its_keys_takes_llama_cpps_defaults(tmp_path, tiny_model, arch):
    """What llama.cpp assumes where a Gemma file lacks a key (gguf_families): Gemma 2 a window of 4096 on every
    other layer, soft-caps 50 and 30, its local RoPE base the global one; Gemma 3 no window, so every layer global,
    a local base of 10000; both queries scaled by head_dim. The norms read back without the converter's + 1."""
    hf = tiny_model("qwen2")  # tied: llama.cpp's Gemma 2 has no output tensor
    config = json.loads((hf / "config.json").read_text())
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    norms = {f"blk.{i}.{n}.weight": (np.full(hidden, 1.25, np.float32), QType.F32) for i in range(layers)
             for n in ("ffn_norm", "post_ffw_norm")}  # fmt: skip
    checkpoint = GGUFCheckpoint(write_gguf(hf, tmp_path / f"{arch}.gguf", QType.F32, arch=arch, **norms))
    raw = checkpoint.config({})
    local = ["sliding_attention" if arch == "gemma2" and i % 2 == 0 else "full_attention" for i in range(layers)]
    head_dim = hidden // config["num_attention_heads"]
    assert (raw["layer_types"], raw["query_pre_attn_scalar"]) == (local, head_dim)
    softcaps = (50.0, 30.0) if arch == "gemma2" else (None, None)
    assert (raw["attn_logit_softcapping"], raw["final_logit_softcapping"]) == softcaps
    assert raw["rope_local_base_freq"] == (raw["rope_theta"] if arch == "gemma2" else 10000.0)
    weights = dict(checkpoint.weights({}))
    assert torch.equal(weights["model.layers.0.pre_feedforward_layernorm.weight"], torch.full((hidden,), 0.25))


def mapped_rss(path) -> int:
    """Bytes of `path` resident in this process's mappings of it (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0]:  # a mapping's header: address range, perms, ..., path
            inside = line.endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux's /proc/self/smaps")
def test_reading_the_weights_hands_back_the_file_s_pages(tmp_path):
    """Each tensor's pages of the map go once the next is asked for: a model does not hold the file besides its
    weights; a tensor kept past that reads its pages again, unchanged."""
    from tiffin.tiny import make_tiny_model

    hf = make_tiny_model(tmp_path / "hf", arch="llama", hidden_size=1024, intermediate_size=1024, rope_scaling=None)
    path = write_gguf(hf, tmp_path / "m.gguf", QType.Q8_0)
    checkpoint = GGUFCheckpoint(path)
    weights = checkpoint.weights(checkpoint.kept({}))
    _, first = next(weights)
    kept_copy = first.clone()
    assert mapped_rss(path) >= first.nbytes
    rest = dict(weights)
    assert len(rest) == len(checkpoint.header.tensors) - 1
    # what the kernel maps around each fault (up to 64 KB, 16 pages, of the file's cached pages) stays
    assert mapped_rss(path) <= len(checkpoint.header.tensors) * 64 * 1024 < path.stat().st_size / 8
    assert torch.equal(first, kept_copy)


# architecture -> weight type written (norms stay F32); qwen3's head_dim differs from hidden / heads
WRITTEN = {"llama": QType.Q4_0, "mistral": QType.Q8_0, "qwen2": QType.F32, "qwen3": QType.Q4_0}
PROMPTS = [[5, 9, 300, 17, 1200, 44], [1, 2, 3, 4, 5, 6], [700, 701, 702, 9, 9, 9], [2000, 3, 150, 77, 8, 1999]]
NEW_TOKENS = 24


@pytest.mark.parametrize("arch", WRITTEN)
def test_written_gguf_matches_transformers(tmp_path, arch):
    """tiffin on the GGUF (Q4_0 / Q8_0 kept quantized) against transformers' own GGUF load (dequantized): greedy
    tokens identical at float32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tiffin import LLM, SamplingParams
    from tiffin.tiny import make_tiny_model

    hf = make_tiny_model(tmp_path / "hf", arch=arch, **({"rope_scaling": None} if arch == "llama" else {}))
    path = write_gguf(hf, tmp_path / "gguf" / f"{arch}.gguf", WRITTEN[arch])
    # transformers reads no head_dim from a qwen3 GGUF (attention.key_length): give it the checkpoint's config
    config = AutoConfig.from_pretrained(hf) if arch == "qwen3" else None
    reference = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, config=config, dtype=torch.float32
    )
    reference.generation_config.eos_token_id = None
    ids = torch.tensor(PROMPTS)
    expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
    # a directory holding one, or the file; transformers' numerics
    llm = LLM(str(path.parent if arch == "mistral" else path), dtype="float32", cpu_quant_compute="exact")
    kept = llm.llm_engine.model_config.quant_config.kept
    assert set(kept.values()) == ({WRITTEN[arch].name} if WRITTEN[arch] != QType.F32 else set())
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected[:, len(PROMPTS[0]) :].tolist()


@pytest.fixture(scope="module", params=[K_QUANT_MIX, LOW_BIT_MIX], ids=["k-quant-mix", "low-bit-mix"])
def mixed_gguf(tmp_path_factory, request):
    from tiffin.tiny import make_tiny_model

    tmp = tmp_path_factory.mktemp("mixed")
    hf = make_tiny_model(tmp / "hf", arch="llama", **K_SHAPES)
    return write_gguf(hf, tmp / "gguf" / "mixed.gguf", QType.Q4_K, types=request.param), request.param


def test_k_quant_mix_matches_transformers(mixed_gguf):
    """Every kept type (the K-quants, Q4/Q5/Q8; then Q2_K, Q3_K, IQ4_NL and IQ4_XS), mixed types stacked in one
    layer: the exact path's greedy tokens are transformers' (which dequantizes with gguf-py) at float32; the native
    kernels' (15-bit activations) the same up to a position where the exact path's two best tokens are within 0.1
    nats."""
    from transformers import AutoModelForCausalLM

    from tiffin import LLM, SamplingParams
    from tiffin.kernels.block_gemm import StackedBlocks

    mixed_gguf, mix = mixed_gguf
    reference = AutoModelForCausalLM.from_pretrained(mixed_gguf.parent, gguf_file=mixed_gguf.name, dtype=torch.float32)
    reference.generation_config.eos_token_id = None
    ids = torch.tensor(PROMPTS)
    expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    outs = {}
    for compute in ("exact", "native"):
        llm = LLM(str(mixed_gguf), dtype="float32", cpu_quant_compute=compute)
        assert set(llm.llm_engine.model_config.quant_config.kept.values()) == {t.name for t in mix.values()}
        model = llm.llm_engine.model_runner.model
        assert isinstance(model.model.layers[0].self_attn.qkv_proj.blocks, StackedBlocks)
        outs[compute] = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    assert [o.token_ids for o in outs["exact"]] == expected[:, len(PROMPTS[0]) :].tolist()
    for exact, native in zip(outs["exact"], outs["native"]):
        split = next((i for i, (a, b) in enumerate(zip(exact.token_ids, native.token_ids)) if a != b), None)
        if split is not None:
            best, second = sorted((v.logprob for v in exact.logprobs[split].values()), reverse=True)[:2]
            assert best - second < 0.1, (split, best - second)
