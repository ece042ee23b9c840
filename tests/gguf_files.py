"""Test helpers: GGUF files written by the `gguf` package's own writer from a tiny Hugging Face checkpoint,
laid out as llama.cpp's converter lays them out (llama q/k rows interleaved, Mistral as a "llama" named so)."""

import json
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType
from safetensors.numpy import load_file

GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "granite": "granite"}
GGUF_ARCH |= {"smollm3": "smollm3", "olmo2": "olmo2"}
PERMUTED = ("llama", "granite", "smollm3")  # the q/k rows llama.cpp's converter interleaves (its LlamaModel's)
# Granite's config.json multipliers -> the scales llama.cpp's converter writes for them
GRANITE_SCALES = {
    "embedding_multiplier": gguf.Keys.LLM.EMBEDDING_SCALE,
    "residual_multiplier": gguf.Keys.LLM.RESIDUAL_SCALE,
    "attention_multiplier": gguf.Keys.Attention.SCALE,
    "logits_scaling": gguf.Keys.LLM.LOGIT_SCALE,
}


# A Q4_K_M-like file over every kept type, on a model whose inputs are whole K-quant super-blocks (256): stacked
# layers mixing types (q/k/v, gate/up), a tied Q6_K embedding, each other type somewhere.
K_QUANT_MIX = {
    "token_embd.weight": QType.Q6_K,
    "blk.0.attn_q.weight": QType.Q4_K,
    "blk.0.attn_k.weight": QType.Q4_K,
    "blk.0.attn_v.weight": QType.Q6_K,
    "blk.0.attn_output.weight": QType.Q5_K,
    "blk.0.ffn_gate.weight": QType.Q5_0,
    "blk.0.ffn_up.weight": QType.Q5_1,
    "blk.0.ffn_down.weight": QType.Q6_K,
    "blk.1.attn_q.weight": QType.Q8_0,
    "blk.1.attn_k.weight": QType.Q4_0,
    "blk.1.attn_v.weight": QType.Q4_1,
    "blk.1.attn_output.weight": QType.Q4_K,
    "blk.1.ffn_gate.weight": QType.Q4_K,
    "blk.1.ffn_up.weight": QType.Q4_K,
    "blk.1.ffn_down.weight": QType.Q5_K,
}
# The types below 4 bits and IQ4's the same way, on the same model.
LOW_BIT_MIX = {
    "token_embd.weight": QType.IQ4_XS,
    "blk.0.attn_q.weight": QType.Q3_K,
    "blk.0.attn_k.weight": QType.Q3_K,
    "blk.0.attn_v.weight": QType.Q2_K,
    "blk.0.attn_output.weight": QType.IQ4_NL,
    "blk.0.ffn_gate.weight": QType.IQ4_XS,
    "blk.0.ffn_up.weight": QType.Q3_K,
    "blk.0.ffn_down.weight": QType.Q2_K,
    "blk.1.attn_q.weight": QType.IQ4_NL,
    "blk.1.attn_k.weight": QType.IQ4_XS,
    "blk.1.attn_v.weight": QType.Q3_K,
    "blk.1.attn_output.weight": QType.Q2_K,
    "blk.1.ffn_gate.weight": QType.IQ4_NL,
    "blk.1.ffn_up.weight": QType.IQ4_NL,
    "blk.1.ffn_down.weight": QType.IQ4_XS,
}
K_SHAPES = dict(hidden_size=256, intermediate_size=512, tie_word_embeddings=True, rope_scaling=None)


def write_gguf(
    hf_dir: str | Path,
    out: str | Path,
    qtype: QType,
    arch: str | None = None,
    big_endian: bool = False,
    types: dict[str, QType] | None = None,
    pre: str | None = None,
    **raw_tensors,
) -> Path:
    """The checkpoint at `hf_dir` as a GGUF with every 2-D weight in `qtype` (norms stay F32), or in `types[name]`
    (gguf names) where given. `arch` overrides the architecture written, `pre` is llama.cpp's pre-tokenizer named
    (tokenizer.ggml.pre); `raw_tensors` (gguf name -> (uint8 array,
    type)) are added as they are."""
    types = types or {}
    hf_dir, out = Path(hf_dir), Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = json.loads((hf_dir / "config.json").read_text())
    arch = arch or GGUF_ARCH[config["model_type"]]
    layers, heads, kv_heads = config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    w = gguf.GGUFWriter(out, arch, endianess=gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE)
    w.add_name(f"tiny {config['model_type']}")
    w.add_block_count(layers)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
    for name, key in GRANITE_SCALES.items():
        if name in config:
            w.add_float32(key.format(arch=arch), config[name])
    w.add_vocab_size(config["vocab_size"])
    _add_tokenizer(w, hf_dir)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    name_map = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), layers)
    for name, data in load_file(hf_dir / "model.safetensors").items():
        data = data.astype(np.float32)
        if arch in PERMUTED and (".q_proj." in name or ".k_proj." in name):
            data = _llama_cpp_permute(data, heads if ".q_proj." in name else kv_heads)
        gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if data.ndim == 2 and qtype != QType.F32:
            w.add_tensor(gguf_name, quantize(data, types.get(gguf_name, qtype)), raw_dtype=types.get(gguf_name, qtype))
        else:
            w.add_tensor(gguf_name, data)
    for gguf_name, (data, raw_type) in raw_tensors.items():
        w.add_tensor(gguf_name, data, raw_dtype=raw_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _add_tokenizer(w: gguf.GGUFWriter, hf_dir: Path) -> None:
    tokenizer = json.loads((hf_dir / "tokenizer.json").read_text())
    tokenizer_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    vocab = {**tokenizer["model"]["vocab"], **{t["content"]: t["id"] for t in tokenizer["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in tokenizer["added_tokens"]}
    merges = tokenizer["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(vocab[tokenizer_config["bos_token"]])
    w.add_eos_token_id(vocab[tokenizer_config["eos_token"]])
    w.add_chat_template(tokenizer_config["chat_template"])


def _llama_cpp_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: within each head, the two rotary halves interleaved row by row."""
    return rows.reshape(heads, 2, -1, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def quantize(data: np.ndarray, qtype: QType) -> np.ndarray:
    """`data` `[N, K]` in `qtype`'s rows: gguf-py's quantizer where it has one; the K-quants and IQ4's by plain
    rounding (scales from each sub-block's range, not llama.cpp's search): valid blocks near the weights."""
    if qtype in (QType.Q4_K, QType.Q5_K):
        return _quantize_k_mins(data, 5 if qtype == QType.Q5_K else 4)
    quantizers = {QType.Q6_K: _quantize_q6_k, QType.Q3_K: _quantize_q3_k, QType.Q2_K: _quantize_q2_k}
    quantizers |= {QType.IQ4_NL: lambda x: _quantize_iq4(x, False), QType.IQ4_XS: lambda x: _quantize_iq4(x, True)}
    return quantizers[qtype](data) if qtype in quantizers else gguf.quantize(data, qtype)


def _half(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _quantize_k_mins(data: np.ndarray, bits: int) -> np.ndarray:
    n = data.shape[0]
    x = data.reshape(n, -1, 8, 32).astype(np.float32)  # [N, supers, sub-block, input]
    mins = np.maximum(0, -x.min(-1))
    steps = (x.max(-1) + mins) / (2**bits - 1)
    d, dmin = _half(steps.max(-1) / 63), _half(mins.max(-1) / 63)
    safe = lambda v: np.where(v == 0, 1, v)
    sc = np.clip(np.rint(steps / safe(d.astype(np.float32))[..., None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(mins / safe(dmin.astype(np.float32))[..., None]), 0, 63).astype(np.uint8)
    step = (d.astype(np.float32)[..., None] * sc)[..., None]
    shift = (dmin.astype(np.float32)[..., None] * mn)[..., None]
    q = np.clip(np.rint((x + shift) / safe(step)), 0, 2**bits - 1).astype(np.uint8)
    packed = np.concatenate(  # 6-bit scales and mins: bytes 0-3, 4-7, then 8-11 (see get_scale_min)
        [sc[..., :4] | ((sc[..., 4:] >> 4) << 6), mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
         (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)], axis=-1)  # fmt: skip
    qs = (q[..., 0::2, :] & 15) | ((q[..., 1::2, :] & 15) << 4)  # [N, supers, 4, 32]
    fields = [d.view(np.uint8).reshape(n, -1, 2), dmin.view(np.uint8).reshape(n, -1, 2), packed]
    if bits == 5:
        fields.append(((q >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(-2, dtype=np.uint8))
    fields.append(qs.reshape(n, -1, 128))
    return np.concatenate(fields, axis=-1).reshape(n, -1)


def _quantize_q6_k(data: np.ndarray) -> np.ndarray:
    n = data.shape[0]
    x = data.reshape(n, -1, 16, 16).astype(np.float32)  # [N, supers, sub-block, input]
    steps = np.abs(x).max(-1) / 31
    d = _half(steps.max(-1) / 127)
    safe = lambda v: np.where(v == 0, 1, v)
    sc = np.clip(np.rint(steps / safe(d.astype(np.float32))[..., None]), -128, 127).astype(np.int8)
    q = np.clip(np.rint(x / safe(d.astype(np.float32)[..., None, None] * sc[..., None])) + 32, 0, 63).astype(np.uint8)
    q = q.reshape(n, -1, 2, 4, 32)  # [N, supers, half, quarter, input]
    ql = (q[:, :, :, :2] & 15) | ((q[:, :, :, 2:] & 15) << 4)  # byte 32s + l: quarters s and s + 2
    qh = ((q >> 4) << np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]).sum(3, dtype=np.uint8)
    fields = [ql.reshape(n, -1, 128), qh.reshape(n, -1, 64), sc.view(np.uint8).reshape(n, -1, 16)]
    return np.concatenate([*fields, d.view(np.uint8).reshape(n, -1, 2)], axis=-1).reshape(n, -1)


def _pairs(q: np.ndarray) -> np.ndarray:
    """2-bit codes `[..., 256]` as Q2_K / Q3_K's 64 bytes: pair s of byte l of chunk c is input 128c + 32s + l."""
    q = (q & 3).reshape(*q.shape[:-1], 2, 4, 32)
    return (q << np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]).sum(-2, dtype=np.uint8).reshape(*q.shape[:-3], 64)


def _quantize_q3_k(data: np.ndarray) -> np.ndarray:
    n = data.shape[0]
    x = data.reshape(n, -1, 16, 16).astype(np.float32)
    steps = np.abs(x).max(-1) / 4
    d = _half(steps.max(-1) / 31)
    safe = lambda v: np.where(v == 0, 1, v)
    sc = np.clip(np.rint(steps / safe(d.astype(np.float32))[..., None]), -32, 31).astype(np.int8)
    step = (d.astype(np.float32)[..., None] * sc)[..., None]
    q = np.clip(np.rint(x / safe(step)) + 4, 0, 7).astype(np.uint8).reshape(n, -1, 256)
    hmask = ((q >> 2).reshape(n, -1, 8, 32) << np.arange(8, dtype=np.uint8)[:, None]).sum(-2, dtype=np.uint8)
    ls = (sc.astype(np.int16) + 32).astype(np.uint8)  # [N, supers, 16]
    high = ((ls >> 4).reshape(n, -1, 4, 4) << np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]).sum(-2, dtype=np.uint8)
    scales = np.concatenate([(ls[..., :8] & 15) | ((ls[..., 8:] & 15) << 4), high], axis=-1)
    fields = [hmask, _pairs(q), scales, d.view(np.uint8).reshape(n, -1, 2)]
    return np.concatenate(fields, axis=-1).reshape(n, -1)


def _quantize_q2_k(data: np.ndarray) -> np.ndarray:
    n = data.shape[0]
    x = data.reshape(n, -1, 16, 16).astype(np.float32)
    mins = np.maximum(0, -x.min(-1))
    steps = (x.max(-1) + mins) / 3
    d, dmin = _half(steps.max(-1) / 15), _half(mins.max(-1) / 15)
    safe = lambda v: np.where(v == 0, 1, v)
    sc = np.clip(np.rint(steps / safe(d.astype(np.float32))[..., None]), 0, 15).astype(np.uint8)
    mn = np.clip(np.rint(mins / safe(dmin.astype(np.float32))[..., None]), 0, 15).astype(np.uint8)
    step = (d.astype(np.float32)[..., None] * sc)[..., None]
    shift = (dmin.astype(np.float32)[..., None] * mn)[..., None]
    q = np.clip(np.rint((x + shift) / safe(step)), 0, 3).astype(np.uint8).reshape(n, -1, 256)
    fields = [sc | (mn << 4), _pairs(q), d.view(np.uint8).reshape(n, -1, 2), dmin.view(np.uint8).reshape(n, -1, 2)]
    return np.concatenate(fields, axis=-1).reshape(n, -1)


def _quantize_iq4(data: np.ndarray, xs: bool) -> np.ndarray:
    """IQ4_NL (a fp16 scale a block of 32) or IQ4_XS (a super-block's fp16 d times a 6-bit scale a block): each
    input the nearest of the 16 values times its block's scale."""
    n, values = data.shape[0], np.array(gguf.quants.IQ4_NL.kvalues, dtype=np.float32)
    x = data.reshape(n, -1, 8 if xs else 1, 32).astype(np.float32)
    steps = np.abs(x).max(-1) / 127
    safe = lambda v: np.where(v == 0, 1, v)
    if xs:
        d = _half(steps.max(-1) / 31)
        sc = np.clip(np.rint(steps / safe(d.astype(np.float32))[..., None]), -32, 31).astype(np.int16)
        step = d.astype(np.float32)[..., None] * sc
    else:
        d = _half(steps[..., 0])
        step = d.astype(np.float32)[..., None]
    q = np.abs((x / safe(step)[..., None])[..., None] - values).argmin(-1).astype(np.uint8)
    qs = (q[..., :16] | (q[..., 16:] << 4)).reshape(n, q.shape[1], -1)
    fields = [d.view(np.uint8).reshape(n, -1, 2)]
    if xs:
        ls = (sc + 32).astype(np.uint16)
        high = ((ls >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(-1, dtype=np.uint16)
        fields += [
            high.view(np.uint8).reshape(n, -1, 2),
            ((ls[..., 0::2] & 15) | ((ls[..., 1::2] & 15) << 4)).astype(np.uint8),
        ]
    return np.concatenate([*fields, qs], axis=-1).reshape(n, -1)
