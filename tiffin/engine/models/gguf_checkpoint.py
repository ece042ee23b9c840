"""GGUF files (llama.cpp's format): the Hugging Face config their metadata implies and their tensors under
Hugging Face names, the header read by `gguf_header`, the tensors' shapes checked against the metadata by
`gguf_shapes`, the tensors mapped from the file and dequantized by the `gguf` package (the tokenizer and chat
template: transformers' GGUF conversion, `tiffin.engine.models.source.load_tokenizer`).

Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q2_K to Q6_K, IQ4_NL and IQ4_XS tensors stay quantized (tiffin.quant.gguf) where a
layer can hold them: the config names them in its `quantization_config`, and they come out as stored (the raw
blocks, `uint8 [rows, row_bytes]`). Every other tensor comes out dequantized to float32 by the `gguf` package
(vectorized numpy).
llama.cpp's converter interleaves the rows of the q/k projections of Llama and the models it converts as Llama
(`Architecture.gguf_permuted_qk`: its rotary embedding pairs adjacent dims, Hugging Face's pairs halves); the
rows are put back here, whatever their type, since a row is always whole blocks. Mixtures of experts (qwen2moe,
qwen3moe, and llama with an expert count: Mixtral) hold each layer's experts stacked, `ffn_{gate,up,down}_exps`
`[experts, rows, inputs]`, read as `mlp.experts.{gate,up,down}_proj.weight` (kept ones as `[experts * rows,
row_bytes]`), their router `ffn_gate_inp` and Qwen2-MoE's shared expert (`ffn_*_shexp`, `ffn_gate_inp_shexp`);
the routing llama.cpp applies per architecture (its top-k weights renormalized but for qwen2moe's) goes into the
config. SmolLM3's NoPE layers are every 4th, as llama.cpp fixes them (the registry's default). What the converter
writes differently for Granite, Gemma 2/3, Phi-3 and DeepSeek (their config keys, shifted norms, fused or split
layers): `gguf_families`.

Model files are untrusted input. Their header is read only as far as it is checked against the file's size
(`gguf_header`); then every metadata value read is checked for its type and bounds, and every dimension
it declares against the tensors present, each refusal a ValueError naming the field. So a file that opens
builds no layer larger than its own tensors, and nothing sized per position beyond MAX_CONTEXT.
"""

import functools
import math
import mmap
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from gguf import Keys
from tqdm.auto import tqdm

from tiffin.engine.models.gguf_families import FAMILIES, FUSED, PLAIN
from tiffin.engine.models.gguf_header import Array, TensorInfo, check_header
from tiffin.engine.models.gguf_shapes import Dims, check_shapes
from tiffin.engine.models.registry import get_architecture, gguf_architecture
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
    QType.Q2_K,
    QType.Q3_K,
    QType.IQ4_NL,
    QType.IQ4_XS,
)
# the types whose values a big-endian file stores byte-swapped, as numpy reads them
BYTE_ORDERED = {QType.F32: np.float32, QType.F16: np.float16}
# a layer's MLP: dense, or a mixture of experts (the router and the stacked experts; Qwen2-MoE's shared expert)
DENSE_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
MOE_MODULES = ("mlp.gate", "mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj")
SHARED_EXPERT = (*(f"mlp.shared_expert.{m}" for m in ("gate_proj", "up_proj", "down_proj")), "mlp.shared_expert_gate")
# Hugging Face module names, per layer and global, that a supported GGUF may hold
LAYER_MODULES = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    *DENSE_MLP,
    *MOE_MODULES,
    *SHARED_EXPERT,
)
GLOBAL_MODULES = ("model.embed_tokens", "model.norm", "lm_head")
# the tensors that pin every dimension the metadata declares: of the layers', those the architecture has in
# llama.cpp's naming (OLMo 2 no input_layernorm; Llama no post_feedforward_layernorm), q/k norms aside
REQUIRED_MODULES = ("model.embed_tokens", "model.norm")
OPTIONAL_LAYER_MODULES = ("self_attn.q_norm", "self_attn.k_norm", *SHARED_EXPERT)
# a GGUF dense architecture -> the Hugging Face one its files with experts are (llama.cpp writes Mixtral as llama)
WITH_EXPERTS = {"LlamaForCausalLM": "MixtralForCausalLM"}
UNNORMALIZED_TOPK = ("qwen2moe",)  # llama.cpp renormalizes the top-k routing weights of every other MoE
# The longest context a GGUF file may declare: above any published model's (10M tokens), and far below the
# 2^32 that would make the per-position tables (rotary cos/sin, block tables) sized from it exhaust memory.
MAX_CONTEXT = 1 << 24
MAX_INT = (1 << 31) - 1  # sizes and ids stay within torch's int32 indexing
BLOCK = re.compile(r"blk\.(\d+)\.")


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
    """One GGUF file, parsed once. Invariant: a checkpoint that constructs is consistent (see the module's
    docstring): `dims` holds the checked dimensions and every tensor has the shape they imply."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.header = check_header(self.path)
        with open(self.path, "rb") as f:  # copy-on-write: its tensors are writable views, not copied
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self.mapped = np.frombuffer(self.map, dtype=np.uint8)
        self.arch = ""  # llama.cpp's name, which keys are spelled with: general.architecture's own is not
        self.arch = self.text(Keys.General.ARCHITECTURE)
        self.architecture = gguf_architecture(self.arch, self.path.name)
        self.family = FAMILIES.get(self.arch, PLAIN)
        if self.field(Keys.LLM.EXPERT_COUNT):
            self.architecture = WITH_EXPERTS.get(self.architecture, self.architecture)
        self.tensor_types = {t.name: t.qtype for t in self.header.tensors}
        # ggml lists dims innermost first; llama-quantize writes a shared expert's one-output gate 1-d
        self.tensor_shapes = {t.name: _as_matrix(t.name, tuple(reversed(t.dims))) for t in self.header.tensors}
        unsupported = sorted({t.name for t in self.tensor_types.values() if t not in TYPES})
        if unsupported:
            raise self.fail(
                f"tensor type(s) {', '.join(unsupported)} not supported; tiffin reads "
                f"{', '.join(t.name for t in TYPES)}"
            )
        if "rope_freqs.weight" in self.tensor_types:
            raise self.fail("per-frequency RoPE factors (rope_freqs: llama3 scaling) are not supported")
        layers = self._block_count()
        self.hf_names = self._hf_names(layers)
        self.dims = self._dims(layers)

    def key(self, key: str) -> str:
        return key.format(arch=self.arch)

    def fail(self, message: str) -> ValueError:
        return ValueError(f"{self.path.name}: GGUF {message}")

    def field(self, key: str, default: Any = None) -> Any:
        value = self.header.fields.get(self.key(key), default)
        if not isinstance(value, bytes):
            return value
        try:
            return value.decode()
        except UnicodeDecodeError as e:
            raise self.fail(f"{self.key(key)}: {e}") from None

    def text(self, key: str, default: str | None = None) -> str:
        value = self.field(key, default)
        if value is None:
            raise self.fail(f"metadata lacks {self.key(key)}")
        if not isinstance(value, str):
            raise self.fail(f"{self.key(key)} is {value!r}, not a string")
        return value

    def integer(self, key: str, default: int | None = None, low: int = 1, high: int = MAX_INT) -> int | None:
        """Metadata `key`, `default` when absent; ValueError naming it unless an integer from `low` to `high`."""
        value = self.field(key, default)
        if value is not None and (type(value) is not int or not low <= value <= high):
            raise self.fail(f"{self.key(key)} is {value!r}; expected an integer from {low} to {high}")
        return value

    def required(self, key: str) -> int:
        value = self.integer(key)
        if value is None:
            raise self.fail(f"metadata lacks {self.key(key)}")
        return value

    def positive(self, key: str, default: float | None = None) -> float:
        """Metadata `key`, `default` when absent; ValueError naming it unless a finite number above 0."""
        value = self.field(key, default)
        if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
            raise self.fail(f"{self.key(key)} is {value!r}; expected a finite number above 0")
        return value

    def config(self, stacked_modules: dict[str, tuple[str, int]]) -> dict:
        """The config.json a Hugging Face checkpoint of this model would carry, with the tensors that stay
        quantized in its `quantization_config` (see `kept`)."""
        dims = self.dims
        config = {
            "architectures": [self.architecture],
            "model_type": self.architecture.removesuffix("ForCausalLM").lower(),
            "vocab_size": dims.vocab,
            "hidden_size": dims.hidden,
            "intermediate_size": dims.ffn,
            "num_hidden_layers": dims.layers,
            "num_attention_heads": dims.heads,
            "num_key_value_heads": dims.kv_heads,
            "head_dim": dims.head_dim,
            "rms_norm_eps": self.positive(Keys.Attention.LAYERNORM_RMS_EPS, 1e-6),
            "rope_theta": self.positive(Keys.Rope.FREQ_BASE, 10000.0),
            "max_position_embeddings": dims.context,
            "tie_word_embeddings": "output.weight" not in self.tensor_types,
            "attention_bias": "blk.0.attn_q.bias" in self.tensor_types,
            "sliding_window": self.integer(Keys.Attention.SLIDING_WINDOW, low=0),  # 0: none, as before
            "bos_token_id": self.field(Keys.Tokenizer.BOS_ID),
            "eos_token_id": self.field(Keys.Tokenizer.EOS_ID),
            "quantization_config": {"quant_method": "gguf", "kept": self.kept(stacked_modules)},
        }
        if dims.experts:
            config |= {
                "num_experts": dims.experts,
                "num_experts_per_tok": dims.experts_used,
                "moe_intermediate_size": dims.expert_ffn,
                "shared_expert_intermediate_size": dims.shared_ffn,
                "norm_topk_prob": self.arch not in UNNORMALIZED_TOPK,
            }
        scaling = self.text(Keys.Rope.SCALING_TYPE, "none")
        if scaling == "linear":
            config["rope_scaling"] = {"rope_type": "linear", "factor": self.positive(Keys.Rope.SCALING_FACTOR)}
        elif scaling != "none":
            raise self.fail(f"RoPE scaling {scaling!r} is not supported (none, linear)")
        return config | self.family.config(self)

    def small_tensor(self, name: str, size: int) -> list[float]:
        """The `size` values of 1-D tensor `name` (a config's, as Phi-3's RoPE factors), as floats."""
        if self.tensor_shapes[name] != (size,):
            raise self.fail(f"tensor {name!r} has shape {list(self.tensor_shapes[name])}, not [{size}]")
        t = next(t for t in self.header.tensors if t.name == name)
        return self._tensor(t, {})[1].tolist()

    def kept(self, stacked_modules: dict[str, tuple[str, int]]) -> dict[str, str]:
        """Hugging Face name -> type of the 2-D tensors that stay quantized: those of a type `KEPT_TYPES` holds, where
        every tensor stacked with it into one layer (`stacked_modules`: q/k/v, gate/up) is too (each shard keeps
        its own type); a group with any other type is dequantized whole. A layer the file stores fused (Phi-3's
        qkv_proj) is kept under its own name and its shards' (which the layer's method is chosen by)."""
        types = {self.hf_names[name]: qtype for name, qtype in self.tensor_types.items() if name in self.hf_names}
        types = {name: t for name, t in types.items() if not any(part in name for part in self.family.dequantized)}
        kept = {}
        for name, qtype in types.items():
            module, _, _ = name.rpartition(".")
            parent, _, leaf = module.rpartition(".")
            stacked = stacked_modules.get(leaf, (leaf, 0))[0]
            shards = [f"{parent}.{n}.weight" for n, (s, _) in stacked_modules.items() if s == stacked]
            fused = leaf == stacked and bool(shards)
            if qtype in KEPT_TYPES and all(types.get(g) in KEPT_TYPES for g in ([name] if fused else shards or [name])):
                kept |= dict.fromkeys([name, *shards] if fused else [name], qtype.name)
        return kept

    def eos_token_ids(self) -> set[int]:
        """End-of-sequence and end-of-turn ids (llama.cpp stops at either)."""
        keys = (Keys.Tokenizer.EOS_ID, Keys.Tokenizer.EOT_ID, Keys.Tokenizer.EOM_ID)
        return {self.field(key) for key in keys} - {None}

    def weights(self, kept: dict[str, str], skip=lambda name: False) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, tensor) for every tensor: the raw blocks of those `kept` (views of the file's map), the
        others float32. Once the consumer asks for the next, a tensor's pages of the map are handed back: a model
        loads holding about its own weights, not those and the file's pages besides (a view kept longer reads its
        pages from the file again: nothing writes to the map). Those whose name `skip` returns True for are not
        read. A family may regroup them as its model takes them (`GGUFFamily.regroup`)."""
        return self.family.regroup(self._weights(kept, skip))

    def _weights(self, kept: dict[str, str], skip) -> Iterator[tuple[str, torch.Tensor]]:
        for t in tqdm(self.header.tensors, desc="Loading weights", unit="tensor"):
            if t.name not in self.hf_names or skip(self.hf_names[t.name]):  # a config's tensor (Phi-3's RoPE factors)
                continue
            yield self._tensor(t, kept)
            self._release(t.start, t.n_bytes)

    def _release(self, start: int, length: int) -> None:
        first = start // mmap.PAGESIZE * mmap.PAGESIZE
        self.map.madvise(mmap.MADV_DONTNEED, first, min(len(self.map), start + length) - first)

    def _tensor(self, t: TensorInfo, kept: dict[str, str]) -> tuple[str, torch.Tensor]:
        name, shape = self.hf_names.get(t.name, t.name), self.tensor_shapes[t.name]
        rows = self.mapped[t.start : t.start + t.n_bytes].reshape(math.prod(shape[:-1]), -1)
        if name in kept:
            data = rows
        else:
            if self.header.byte_order == ">" and t.qtype in BYTE_ORDERED:  # what the `gguf` package's reader swaps
                rows = rows.view(BYTE_ORDERED[t.qtype]).byteswap().view(np.uint8)
            data = gguf.dequantize(rows, t.qtype).reshape(shape)
            if self.family.norm_offset and name.endswith("norm.weight"):
                data = data - self.family.norm_offset
        permuted = get_architecture(self.architecture).gguf_permuted_qk
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            heads = self.dims.heads if ".q_proj." in name else self.dims.kv_heads
            data = _undo_rope_permutation(data, heads)
        return name, torch.from_numpy(data)

    def _block_count(self) -> int:
        """block_count, once it names exactly the blocks whose blk.N tensors the file holds: the name map and
        the layers are built per block, so a count the tensors do not back is refused before either."""
        layers = self.required(Keys.LLM.BLOCK_COUNT)
        present = {int(m[1]) for name in self.tensor_types if (m := BLOCK.match(name))}
        if len(present) != layers or present != set(range(layers)):  # lengths first: range(2^31) as a set takes GBs
            held = f"{len(present)} blocks" + (f", blk.{min(present)} to blk.{max(present)}" if present else "")
            raise self.fail(f"{self.key(Keys.LLM.BLOCK_COUNT)} is {layers}, but the file holds tensors of {held}")
        return layers

    def _hf_names(self, layers: int) -> dict[str, str]:
        """GGUF tensor name -> Hugging Face name, once every tensor that pins a dimension is present."""
        arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == self.arch)
        name_map = gguf.get_tensor_name_map(arch, layers)
        apart = {shard for fused in self.family.fused for shard in FUSED[fused]}
        modules = [*(m for m in LAYER_MODULES if m not in apart), *self.family.fused, *self.family.modules]
        layer_modules = [f"model.layers.{i}.{m}" for i in range(layers) for m in modules]
        to_hf = {name_map.get_name(name): name for name in (*GLOBAL_MODULES, *layer_modules)}
        to_hf.pop(None, None)  # modules the architecture lacks
        names = {}
        for name in self.tensor_types:
            base, _, suffix = name.rpartition(".")
            if base in self.family.config_tensors:
                continue
            if base not in to_hf:
                raise self.fail(f"tensor {name!r} has no place in a {self.arch} model")
            names[name] = f"{to_hf[base]}.{suffix}"
        # a layer's MLP is the dense one or the experts, as the metadata says
        other_mlp = DENSE_MLP if self.field(Keys.LLM.EXPERT_COUNT) else MOE_MODULES
        optional = (*OPTIONAL_LAYER_MODULES, *other_mlp, *self.family.optional)
        required = [
            *REQUIRED_MODULES,
            *(f"model.layers.{i}.{m}" for i in range(layers) for m in modules if m not in optional),
        ]
        required = [name for name in required if name in to_hf.values()]
        missing = sorted(set(required) - {name.removesuffix(".weight") for name in names.values()})
        if missing:
            gguf_names = {hf: base for base, hf in to_hf.items()}
            raise self.fail(f"file lacks tensor(s) {', '.join(gguf_names[m] + '.weight' for m in missing[:8])}")
        return names

    def _dims(self, layers: int) -> Dims:
        hidden = self.required(Keys.LLM.EMBEDDING_LENGTH)
        heads = self.required(Keys.Attention.HEAD_COUNT)
        kv_heads = self.integer(Keys.Attention.HEAD_COUNT_KV, heads)
        if heads % kv_heads:
            raise self.fail(
                f"{self.key(Keys.Attention.HEAD_COUNT_KV)} ({kv_heads}) does not divide "
                f"{self.key(Keys.Attention.HEAD_COUNT)} ({heads})"
            )
        head_dim = self.integer(Keys.Attention.KEY_LENGTH) or hidden // heads
        if head_dim % 2 or not head_dim:  # the rotary embedding turns halves of each head
            raise self.fail(f"head dimension {self.head_dim_source()} = {head_dim} is not a positive even number")
        token_list = self.header.fields.get(Keys.Tokenizer.LIST)
        tokens = token_list.length if isinstance(token_list, Array) else None
        vocab = self.integer(Keys.LLM.VOCAB_SIZE) or tokens
        if not vocab:
            raise self.fail(f"metadata lacks {self.key(Keys.LLM.VOCAB_SIZE)} and {Keys.Tokenizer.LIST}")
        if tokens is not None and tokens > vocab:
            vocab_size = self.key(Keys.LLM.VOCAB_SIZE)
            raise self.fail(f"{Keys.Tokenizer.LIST} holds {tokens} tokens, more than {vocab_size} = {vocab}")
        for key in (Keys.Tokenizer.BOS_ID, Keys.Tokenizer.EOS_ID, Keys.Tokenizer.EOT_ID, Keys.Tokenizer.EOM_ID):
            self.integer(key, low=0, high=vocab - 1)
        ffn = self.required(Keys.LLM.FEED_FORWARD_LENGTH)
        context = self.integer(Keys.LLM.CONTEXT_LENGTH, 2048, high=MAX_CONTEXT)
        dims = Dims(vocab, hidden, ffn, layers, heads, kv_heads, head_dim, context, *self._expert_dims(ffn))
        check_shapes(self, dims)
        return dims

    def _expert_dims(self, ffn: int) -> tuple[int, int, int, int]:
        """(experts, experts_used, expert_ffn, shared_ffn); zeros for a dense model."""
        experts = self.integer(Keys.LLM.EXPERT_COUNT, 0, low=0)
        if not experts:
            return 0, 0, 0, 0
        used = self.integer(Keys.LLM.EXPERT_USED_COUNT, high=experts)
        if used is None:
            raise self.fail(f"metadata lacks {self.key(Keys.LLM.EXPERT_USED_COUNT)}")
        expert_ffn = self.integer(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, ffn)
        return experts, used, expert_ffn, self.integer(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, 0, low=0)

    def head_dim_source(self) -> str:
        """The metadata the head dimension comes from: key_length, else embedding_length / head_count."""
        if self.field(Keys.Attention.KEY_LENGTH) is not None:
            return self.key(Keys.Attention.KEY_LENGTH)
        return f"{self.key(Keys.LLM.EMBEDDING_LENGTH)} / {self.key(Keys.Attention.HEAD_COUNT)}"


def _as_matrix(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    return (1, *shape) if name.endswith("ffn_gate_inp_shexp.weight") and len(shape) == 1 else shape


def _undo_rope_permutation(rows: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: within each head, rows (0, half, 1, half+1, ...) back to halves."""
    return rows.reshape(heads, -1, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)
