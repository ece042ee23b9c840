"""GGUF files (llama.cpp's format), read with the `gguf` package: the Hugging Face config their metadata
implies and their tensors under Hugging Face names (the tokenizer and chat template: transformers' GGUF
conversion, `tiffin.engine.models.source.load_tokenizer`).

Q4_0, Q4_1 and Q8_0 tensors stay quantized (tiffin.quant.gguf) where a layer can hold them: the config names
them in its `quantization_config`, and they come out as stored (the raw blocks, `uint8 [rows, row_bytes]`).
Every other tensor comes out dequantized to float32 by the `gguf` package (vectorized numpy).
llama.cpp's converter interleaves the rows of every llama-family q/k projection (its rotary embedding pairs
adjacent dims, Hugging Face's pairs halves); the rows are put back here, whatever their type, since a row
is always whole blocks.
"""

import functools
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from gguf import Keys
from tqdm.auto import tqdm

from tiffin.engine.models.registry import gguf_architecture
from tiffin.quant.gguf import KEPT_TYPES

TYPES = (
    QType.F32,
    QType.F16,
    QType.BF16,
    QType.Q8_0,
    QType.Q4_0,
    QType.Q4_1,
    QType.Q5_0,
    QType.Q5_1,
    QType.Q4_K,
    QType.Q5_K,
    QType.Q6_K,
)
# Hugging Face module names, per layer and global, that a supported GGUF may hold
LAYER_MODULES = (
    "input_layernorm",
    "post_attention_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
GLOBAL_MODULES = ("model.embed_tokens", "model.norm", "lm_head")


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file `path` names, or the only one in directory `path` (a Hugging Face directory, with its
    config.json, is not a GGUF one); None if `path` holds no GGUF."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return path
    files = sorted(path.glob("*.gguf")) if path.is_dir() and not (path / "config.json").exists() else []
    if len(files) > 1:
        raise ValueError(f"{path} holds several GGUF files ({', '.join(f.name for f in files)}); name one")
    return files[0] if files else None


@functools.lru_cache(maxsize=1)  # the config, the eos ids and the weights of one load share one parse
def open_gguf(path: Path) -> "GGUFCheckpoint":
    return GGUFCheckpoint(path)


class GGUFCheckpoint:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.reader = gguf.GGUFReader(self.path)
        self.arch = self.reader.fields[Keys.General.ARCHITECTURE].contents()  # llama.cpp's name
        self.architecture = gguf_architecture(self.arch, self.path.name)
        self.tensor_types = {t.name: t.tensor_type for t in self.reader.tensors}
        unsupported = sorted({t.name for t in self.tensor_types.values() if t not in TYPES})
        if unsupported:
            raise ValueError(
                f"{self.path.name}: GGUF tensor type(s) {', '.join(unsupported)} not supported; tiffin reads "
                f"{', '.join(t.name for t in TYPES)}"
            )
        if "rope_freqs.weight" in self.tensor_types:
            raise ValueError(
                f"{self.path.name}: GGUF per-frequency RoPE factors (rope_freqs: llama3 scaling) are not supported"
            )
        self.hf_names = self._hf_names()

    def field(self, key: str, default=None):
        field = self.reader.fields.get(key.format(arch=self.arch))
        return default if field is None else field.contents()

    def config(self, stacked_modules: dict[str, tuple[str, int]]) -> dict:
        """The config.json a Hugging Face checkpoint of this model would carry, with the tensors that stay
        quantized in its `quantization_config` (see `kept`)."""
        heads = self.field(Keys.Attention.HEAD_COUNT)
        hidden = self.field(Keys.LLM.EMBEDDING_LENGTH)
        vocab = self.field(Keys.LLM.VOCAB_SIZE) or len(self.field(Keys.Tokenizer.LIST))
        config = {
            "architectures": [self.architecture],
            "model_type": self.architecture.removesuffix("ForCausalLM").lower(),
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": self.field(Keys.LLM.FEED_FORWARD_LENGTH),
            "num_hidden_layers": self.field(Keys.LLM.BLOCK_COUNT),
            "num_attention_heads": heads,
            "num_key_value_heads": self.field(Keys.Attention.HEAD_COUNT_KV, heads),
            "head_dim": self.field(Keys.Attention.KEY_LENGTH) or hidden // heads,
            "rms_norm_eps": self.field(Keys.Attention.LAYERNORM_RMS_EPS, 1e-6),
            "rope_theta": self.field(Keys.Rope.FREQ_BASE, 10000.0),
            "max_position_embeddings": self.field(Keys.LLM.CONTEXT_LENGTH, 2048),
            "tie_word_embeddings": "output.weight" not in self.tensor_types,
            "attention_bias": "blk.0.attn_q.bias" in self.tensor_types,
            "sliding_window": self.field(Keys.Attention.SLIDING_WINDOW),
            "bos_token_id": self.field(Keys.Tokenizer.BOS_ID),
            "eos_token_id": self.field(Keys.Tokenizer.EOS_ID),
            "quantization_config": {"quant_method": "gguf", "kept": self.kept(stacked_modules)},
        }
        scaling = self.field(Keys.Rope.SCALING_TYPE, "none")
        if scaling == "linear":
            config["rope_scaling"] = {"rope_type": "linear", "factor": self.field(Keys.Rope.SCALING_FACTOR)}
        elif scaling != "none":
            raise ValueError(f"{self.path.name}: GGUF RoPE scaling {scaling!r} is not supported (none, linear)")
        return config

    def kept(self, stacked_modules: dict[str, tuple[str, int]]) -> dict[str, str]:
        """Hugging Face name -> type of the 2-D tensors that stay quantized: Q4_0, Q4_1 or Q8_0, and the same
        type as every tensor stacked with it into one layer (`stacked_modules`: q/k/v, gate/up), since a layer
        is stored one way. A group of mixed types is dequantized whole."""
        types = {self.hf_names[name]: qtype for name, qtype in self.tensor_types.items()}
        kept = {}
        for name, qtype in types.items():
            module, _, _ = name.rpartition(".")
            parent, _, leaf = module.rpartition(".")
            stacked = stacked_modules.get(leaf, (leaf, 0))[0]
            group = [f"{parent}.{n}.weight" for n, (s, _) in stacked_modules.items() if s == stacked] or [name]
            if qtype in KEPT_TYPES and all(types.get(g) == qtype for g in group):
                kept[name] = qtype.name
        return kept

    def eos_token_ids(self) -> set[int]:
        """End-of-sequence and end-of-turn ids (llama.cpp stops at either)."""
        keys = (Keys.Tokenizer.EOS_ID, Keys.Tokenizer.EOT_ID, Keys.Tokenizer.EOM_ID)
        return {self.field(key) for key in keys} - {None}

    def weights(self, kept: dict[str, str]) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, tensor) for every tensor: the raw blocks of those `kept`, the others float32."""
        config = self.config({})
        for t in tqdm(self.reader.tensors, desc="Loading weights", unit="tensor"):
            name = self.hf_names[t.name]
            shape = tuple(int(d) for d in reversed(t.shape))  # ggml lists dims innermost first
            if name in kept:
                data = t.data.reshape(shape[0], -1)
            else:
                data = gguf.dequantize(t.data, t.tensor_type).reshape(shape)
            if self.arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
                heads = config["num_attention_heads" if ".q_proj." in name else "num_key_value_heads"]
                data = _undo_rope_permutation(data, heads)
            yield name, torch.from_numpy(np.array(data))  # a copy: the reader's arrays map the file read-only

    def _hf_names(self) -> dict[str, str]:
        layers = self.field(Keys.LLM.BLOCK_COUNT)
        arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == self.arch)
        name_map = gguf.get_tensor_name_map(arch, layers)
        hf = [*GLOBAL_MODULES, *(f"model.layers.{i}.{m}" for i in range(layers) for m in LAYER_MODULES)]
        to_hf = {name_map.get_name(name): name for name in hf}
        names = {}
        for name in self.tensor_types:
            base, _, suffix = name.rpartition(".")
            if base not in to_hf:
                raise ValueError(f"{self.path.name}: GGUF tensor {name!r} has no place in a {self.arch} model")
            names[name] = f"{to_hf[base]}.{suffix}"
        return names


def _undo_rope_permutation(rows: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: within each head, rows (0, half, 1, half+1, ...) back to halves."""
    return rows.reshape(heads, -1, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)
