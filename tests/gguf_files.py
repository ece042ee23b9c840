"""Test helpers: GGUF files written by the `gguf` package's own writer from a tiny Hugging Face checkpoint,
laid out as llama.cpp's converter lays them out (llama q/k rows interleaved, Mistral as a "llama" named so)."""

import json
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType
from safetensors.numpy import load_file

GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def write_gguf(
    hf_dir: str | Path, out: str | Path, qtype: QType, arch: str | None = None, big_endian: bool = False, **raw_tensors
) -> Path:
    """The checkpoint at `hf_dir` as a GGUF with every 2-D weight in `qtype` (norms stay F32). `arch` overrides
    the architecture written; `raw_tensors` (gguf name -> (uint8 array, type)) are added as they are."""
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
    w.add_rope_freq_base(config["rope_theta"])
    w.add_vocab_size(config["vocab_size"])
    _add_tokenizer(w, hf_dir)
    name_map = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), layers)
    for name, data in load_file(hf_dir / "model.safetensors").items():
        data = data.astype(np.float32)
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            data = _llama_cpp_permute(data, heads if ".q_proj." in name else kv_heads)
        gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if data.ndim == 2 and qtype != QType.F32:
            w.add_tensor(gguf_name, gguf.quantize(data, qtype), raw_dtype=qtype)
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
