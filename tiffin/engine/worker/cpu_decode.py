"""Decode-only steps on CPU in one native call for all decoder layers (`kernels/csrc/cpu_decode.cpp`), for a
Llama-family model whose projections all run the int8 kernels: at batch 1 the ~15 ops a layer costs in Python
take longer than their work. The native step runs the same kernels in the same order as the model's torch code
(SiLU aside: its own exp), so its outputs match the model's to float rounding. A mixture of experts' layer
(`models/moe.py`, GGUF experts kept in blocks) runs natively too: the router, then every chosen expert's gate/up and
down projections each in one grouped GEMM over the chosen experts' rows (the others' weights never read).

Invariant: only decode-only steps (one query token a sequence), with no LoRA adapter, run natively."""

import ctypes

import torch

from tiffin.engine.models.layers import MLP
from tiffin.engine.models.llama import LlamaForCausalLM
from tiffin.engine.models.moe import LinearExperts, SparseMoE
from tiffin.kernels import AttentionMetadata, cpu_native, silu_and_mul
from tiffin.kernels.block_gemm import FP8, native_runs, native_weights, parts

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


MAX_PARTS = 3  # cpu_decode.cpp's: q, k and v stored three ways


class _QuantLinear(ctypes.Structure):
    _fields_ = [
        ("parts", ctypes.POINTER(cpu_native.NativeWeights) * MAX_PARTS),
        ("part_features", _i64 * MAX_PARTS),
        ("num_parts", _i64),
        ("bias", _ptr),
        ("out_features", _i64),
        ("in_features", _i64),
        ("levels", _i64),
    ]


class _MoE(ctypes.Structure):
    _fields_ = [
        ("router", _ptr),
        ("gate_up", ctypes.POINTER(_QuantLinear)),
        ("down", ctypes.POINTER(_QuantLinear)),
        *[(name, _i64) for name in ("experts", "top_k", "renormalize")],
        ("shared_gate_up", ctypes.POINTER(_QuantLinear)),
        ("shared_down", ctypes.POINTER(_QuantLinear)),
        ("shared_gate", _ptr),
    ]


class _DecoderLayer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _ptr),
        ("post_norm", _ptr),
        ("q_norm", _ptr),
        ("k_norm", _ptr),
        ("qkv", _QuantLinear),
        ("o", _QuantLinear),
        ("gate_up", _QuantLinear),
        ("down", _QuantLinear),
        ("k_cache", _ptr),
        ("v_cache", _ptr),
        ("k_scale", _ptr),
        ("v_scale", _ptr),
        ("moe", ctypes.POINTER(_MoE)),
    ]


class _Decoder(ctypes.Structure):
    _fields_ = [
        ("dtype", _i64),
        ("cache_dtype", _i64),
        *[(name, _i64) for name in ("hidden", "heads", "kv_heads", "head_dim", "block_size")],
        ("num_layers", _i64),
        ("eps", ctypes.c_double),
        ("scale", ctypes.c_double),
        ("cos", _ptr),
        ("sin", _ptr),
        ("layers", ctypes.POINTER(_DecoderLayer)),
    ]


def _linear(layer) -> _QuantLinear:
    weights = parts(layer.blocks)
    views = [ctypes.pointer(native_weights(w)) for w in weights]
    features = [w.out_features for w in weights]
    return _QuantLinear((ctypes.POINTER(cpu_native.NativeWeights) * MAX_PARTS)(*views), (_i64 * MAX_PARTS)(*features),
                        len(weights), cpu_native.data_ptr(layer.bias), layer.blocks.out_features,
                        layer.blocks.in_features, _levels(weights))  # fmt: skip


def _moe(mlp: SparseMoE) -> _MoE:
    experts, shared = mlp.experts, mlp.shared_expert
    gate_up = (_QuantLinear * len(experts.gate_up_proj))(*map(_linear, experts.gate_up_proj))
    down = (_QuantLinear * len(experts.down_proj))(*map(_linear, experts.down_proj))
    # the router's (and shared gate's) weight as rows: fp32 ones left to MKL are stored column-major
    rows = [x.weight.contiguous() for x in (mlp.gate, mlp.shared_expert_gate) if x is not None]
    moe = _MoE(rows[0].data_ptr(), gate_up, down, len(down), mlp.top_k, mlp.renormalize)
    if shared is not None:
        moe.shared_gate_up, moe.shared_down = (
            ctypes.pointer(_linear(x)) for x in (shared.gate_up_proj, shared.down_proj)
        )
        moe.shared_gate = rows[1].data_ptr()
    moe.rows = rows  # kept alive with the struct (CpuDecoder.moes) that points into them
    return moe


def _plain(linear: torch.nn.Module, dtype: torch.dtype) -> bool:
    """Whether `linear` keeps a plain weight of `dtype` (a CPU prepack keeps one where it looks up rows), no adapter."""
    weight = getattr(linear, "weight", None)
    full = weight is not None and weight.numel() == linear.input_size * linear.output_size
    return full and weight.dtype == dtype and getattr(linear, "adapters", None) is None


def _mlp_linears(mlp: torch.nn.Module, dtype: torch.dtype) -> list | None:
    """The projections of a layer's MLP the native step runs, or None where it does not run that MLP: SiLU MLPs and
    mixtures of experts of them, GGUF experts kept in blocks, whose router and shared expert's gate are plain
    weights of `dtype`."""
    if isinstance(mlp, MLP):
        return [mlp.gate_up_proj, mlp.down_proj] if mlp.act_and_mul is silu_and_mul else None
    if not isinstance(mlp, SparseMoE) or not isinstance(mlp.experts, LinearExperts) or not _plain(mlp.gate, dtype):
        return None
    shared = []
    if mlp.shared_expert is not None:
        shared = _mlp_linears(mlp.shared_expert, dtype)
        if shared is None or not _plain(mlp.shared_expert_gate, dtype):
            return None
    if mlp.experts.act_and_mul is not silu_and_mul:
        return None
    return [*mlp.experts.gate_up_proj, *mlp.experts.down_proj, *shared]


def _levels(weights) -> int:
    """The activation levels of a projection's parts (FP8 parts, on bf16 dot products, take no levels)."""
    return next((w.levels for w in weights if w.kind != FP8), weights[0].levels)


class CpuDecoder:
    def __init__(self, model: LlamaForCausalLM, block_size: int):
        """`model`'s layers as the native step reads them; its KV caches must be allocated already."""
        inner, attn = model.model, model.model.layers[0].self_attn
        layers, self.moes = [], []
        for layer in inner.layers:
            a, mlp = layer.self_attn, layer.mlp
            moe = None if isinstance(mlp, MLP) else _moe(mlp)
            self.moes.append(moe)
            norms = (a.q_norm.weight, a.k_norm.weight) if a.qk_norm else (None, None)
            layers.append(
                _DecoderLayer(
                    layer.input_layernorm.weight.data_ptr(),
                    layer.post_attention_layernorm.weight.data_ptr(),
                    *map(cpu_native.data_ptr, norms),
                    *map(_linear, (a.qkv_proj, a.o_proj)),
                    *(map(_linear, (mlp.gate_up_proj, mlp.down_proj)) if moe is None else [_QuantLinear()] * 2),
                    a.k_cache.data_ptr(),
                    a.v_cache.data_ptr(),
                    cpu_native.data_ptr(a.k_scale),
                    cpu_native.data_ptr(a.v_scale),
                    None if moe is None else ctypes.pointer(moe),
                )
            )
        self.layers = (_DecoderLayer * len(layers))(*layers)
        self.model, self.rotary = model, attn.rotary  # the tensors the pointers point into stay alive
        self.dtype = inner.norm.weight.dtype
        self.decoder = _Decoder(
            cpu_native.DTYPE_CODES[self.dtype],
            cpu_native.CACHE_DTYPE_CODES[attn.k_cache.dtype],
            inner.norm.weight.shape[0],
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            block_size,
            len(layers),
            inner.norm.eps,
            attn.scale,
            attn.rotary.cos.data_ptr(),
            attn.rotary.sin.data_ptr(),
            self.layers,
        )

    @classmethod
    def build(cls, model: torch.nn.Module, block_size: int) -> "CpuDecoder | None":
        """A native decoder for `model`, or None where its steps must run in torch: not the Llama block, a
        projection not on the block kernels (plain, an adapter slot, FP8 without AVX-512 BF16) or whose inputs are
        permuted first, an activation other than SiLU, an MLP `_mlp_linears` does not take, a dtype other than
        fp32 / bf16."""
        if not isinstance(model, LlamaForCausalLM) or not model.plain_block or cpu_native.library() is None:
            return None
        inner = model.model
        for layer in inner.layers:
            a, mlp_linears = layer.self_attn, _mlp_linears(layer.mlp, inner.norm.weight.dtype)
            if mlp_linears is None:
                return None
            linears = (a.qkv_proj, a.o_proj, *mlp_linears)
            if any(getattr(x, "blocks", None) is None or x.adapters is not None for x in linears):
                return None
            if not all(native_runs(w) for x in linears for w in parts(x.blocks)):
                return None  # FP8 on a CPU without AVX-512 BF16: its torch path runs the reference
            if any(getattr(x, "perm", None) is not None or getattr(x, "gather", None) is not None for x in linears):
                return None  # act-order GPTQ: its inputs are permuted first
        if inner.norm.weight.dtype not in cpu_native.DTYPE_CODES or not cpu_native.supports_cache(
            inner.norm.weight, inner.layers[0].self_attn.k_cache
        ):
            return None
        return cls(model, block_size)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        """The final norm's output `[T, hidden]` of a decode-only step (one token a sequence)."""
        inner = self.model.model
        x = inner.embed_tokens(input_ids).contiguous()
        tables = attn.block_tables
        cpu_native.library().tiffin_decode_layers(
            ctypes.addressof(self.decoder),
            x.data_ptr(),
            len(input_ids),
            positions.data_ptr(),
            attn.slot_mapping.data_ptr(),
            tables.data_ptr(),
            tables.stride(0),
            attn.seq_lens.data_ptr(),
            torch.get_num_threads(),
        )
        return inner.norm(x)
