"""Layers shared by the model files: RMSNorm, rotary embedding (default, linear, llama3, yarn and longrope
scaling), the gated MLP and the activations it may use (`ACTIVATIONS`, keyed by config.json's `hidden_act`).

Projections are built through `linear(name, input_size, output_sizes, bias, split, parts)`, the token embedding
and output head through `embedding(name, vocab_size, hidden_size)`, both supplied by the loader: how each weight
is stored (plain, AWQ, GPTQ, GGUF) is not the model's business. Sizes are the checkpoint's; `split` ("column",
"row" or None) and `parts` say how a tensor-parallel rank takes its share (`models/linear.py`).
"""

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from tiffin import kernels
from tiffin.kernels import cpu_native
from tiffin.kernels.lora import LoRAMetadata

LinearFactory = Callable[..., nn.Module]  # (name, input_size, output_sizes, bias, split=None, parts=None)
EmbeddingFactory = Callable[[str, int, int], nn.Module]  # (name, vocab_size, hidden_size) -> an Embedding


# hidden_act -> fn(gate_up [..., 2 * intermediate], backend="torch") -> act(gate) * up [..., intermediate]
ACTIVATIONS: dict[str, Callable[..., torch.Tensor]] = {
    "silu": kernels.silu_and_mul,
    "gelu": kernels.gelu_and_mul,
    "gelu_pytorch_tanh": functools.partial(kernels.gelu_and_mul, approximate="tanh"),
}


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, backend: str = "torch") -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps, backend)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): one kernel on a GPU, the unfused add and norm on CPU."""
        return kernels.add_rms_norm(x, residual, self.weight, self.eps, backend)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None, max_positions: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies `[head_dim / 2]`, attention factor: what cos and sin are scaled by, 1 but for yarn and
    longrope), as transformers' rope init functions compute them. `max_positions` (the engine's context length)
    picks LongRoPE's factors once for every sequence: its long ones where the engine serves past the pretraining
    length, as vLLM does (transformers switches when a sequence crosses it, and re-prefills it then)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / theta**exponents
    kind = scaling["rope_type"] if scaling else "default"
    if kind == "default":
        return inv_freq, 1.0
    factor = scaling["factor"]
    if kind == "linear":
        return inv_freq / factor, 1.0
    original = scaling["original_max_position_embeddings"]
    if kind == "llama3":  # long wavelengths slowed by `factor`, short ones kept, a smooth blend between the two
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        smooth = ((original / (2 * math.pi / inv_freq) - low) / (high - low)).clamp(0, 1)
        return (1 - smooth) * inv_freq / factor + smooth * inv_freq, 1.0
    if kind == "longrope":
        attention = scaling.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        ext = scaling["long_factor" if max_positions > original else "short_factor"]
        return 1.0 / (torch.tensor(ext, dtype=torch.float32) * theta**exponents), attention
    return _yarn(inv_freq, head_dim, theta, factor, original, scaling)


def _yarn(inv_freq: torch.Tensor, head_dim: int, theta: float, factor: float, original: int, scaling: dict):
    """YaRN: dimensions rotating fewer than `beta_slow` times over the pretraining length interpolated by `factor`,
    those rotating more than `beta_fast` times kept, a linear ramp between; attention scaled by its mscale."""

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    def dim_of(rotations: float) -> float:  # the dimension that rotates `rotations` times over `original`
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(m) / mscale(m_all) if m and m_all else mscale(1.0)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp), float(attention)


class RotaryEmbedding(nn.Module):
    """Neox-style rotation (halves, not interleaved pairs), cos/sin precomputed in fp32 per position. The scaling's
    attention factor scales both q and k in transformers: it is left to the attention's softmax scale
    (`attention_scaling`, its square), so the tables stay plain rotations. `theta` None: the identity (cos 1, sin
    0), for the layers of a model without RoPE on them (NoPE), which run through the same fused kernels."""

    def __init__(self, head_dim: int, max_positions: int, theta: float | None, scaling: dict | None):
        super().__init__()
        if theta is None:
            inv_freq, self.attention_scaling = torch.zeros(head_dim // 2), 1.0
        else:
            inv_freq, self.attention_scaling = rope_inv_freq(head_dim, theta, scaling, max_positions)
        freqs = torch.arange(max_positions).float()[:, None] * inv_freq[None, :]  # one half: both halves share it
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def at(self, positions: torch.Tensor) -> "Rotation":
        """The rotation of one forward's tokens, which every layer applies."""
        return Rotation(self, positions)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.at(positions)(x)


class MRotaryEmbedding(RotaryEmbedding):
    """M-RoPE (Qwen2-VL): the rotary dimensions split into `section` runs (of the half table; each half alike) that
    rotate by a token's temporal, height and width positions in turn. Positions [T]: three equal ids, the plain
    rotation. Positions [3, T] (`multimodal.mrope`): each token's rows gathered into tables of its own, read at
    positions 0..T-1, so the native, Triton and torch rotations all apply them unchanged."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None, section: tuple[int, ...]):
        super().__init__(head_dim, max_positions, theta, scaling)
        if len(section) != 3 or sum(section) != head_dim // 2:
            raise ValueError(f"mrope_section {list(section)} must be 3 runs summing to head_dim / 2 = {head_dim // 2}")
        # the output's size given: a model built on the meta device (the whole model rank 0 checks adapters on)
        axis = torch.repeat_interleave(torch.arange(3), torch.tensor(section), output_size=head_dim // 2)
        self.register_buffer("axis", axis, persistent=False)

    def at(self, positions: torch.Tensor) -> "Rotation":
        if positions.ndim == 1:
            return Rotation(self, positions)
        rows = positions[self.axis].T  # [T, head_dim / 2]: each dimension's position
        dims = torch.arange(len(self.axis), device=positions.device)
        tables = RotationTables(self.cos[rows, dims].contiguous(), self.sin[rows, dims].contiguous())
        return Rotation(tables, torch.arange(positions.shape[1], device=positions.device))


class RotationTables(NamedTuple):
    """cos / sin rows a `Rotation` reads at its positions."""

    cos: torch.Tensor
    sin: torch.Tensor


class Rotation:
    """One forward's rotation: its tokens' cos/sin rows are gathered at the first layer and reused by the others.
    It lives for one forward only, so a forward captured in a CUDA graph gathers inside the capture (a cache that
    outlived the forward made replays rotate by the positions of the pass before the capture)."""

    def __init__(self, rotary: RotaryEmbedding, positions: torch.Tensor):
        self.rotary, self.positions, self._cos_sin = rotary, positions, None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate `x` `[T, heads, head_dim]`: the query and key heads in one call (fewer, larger ops); on CPU in
        one native pass where it is built (the same rounding)."""
        r, positions = self.rotary, self.positions
        if cpu_native.supports(x) and r.cos.dtype == torch.float32 and positions.dtype == torch.int64:
            return cpu_native.rotary(x, positions, r.cos, r.sin)
        if self._cos_sin is None:
            self._cos_sin = r.cos[positions].to(x.dtype)[:, None], r.sin[positions].to(x.dtype)[:, None]
        return kernels.fused.rotate(x, *self._cos_sin)

    def rotate_and_write_kv(
        self, qk: torch.Tensor, v: torch.Tensor, attention, slot_mapping: torch.Tensor, backend: str
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Rotate the query and key heads of `qk`, write the keys and `v` to `attention`'s caches -> (the queries,
        the keys and values written: `paged_attention`'s `fresh_kv`, or None where the queries come rotated as a
        quantized cache stores its keys: `query_rotated`); with `attention.qk_norm` (Qwen3) each head is
        RMS-normalized by `q_norm`/`k_norm` before. With Triton, one kernel does it all (the Hadamard rotations of
        a quantized cache too), reading the tables at the positions itself; otherwise the norms, the rotation above
        (gathered once per forward, or the native CPU pass) and `write_kv`, and the attention rotates the queries."""
        norms = (attention.q_norm.weight, attention.k_norm.weight, attention.q_norm.eps) if attention.qk_norm else ()
        if backend == "triton":
            r = self.rotary
            q = kernels.rotary_write_kv(
                qk,
                v,
                attention.k_cache,
                attention.v_cache,
                slot_mapping,
                self.positions,
                r.cos,
                r.sin,
                attention.num_heads,
                backend,
                attention.k_scale,
                attention.v_scale,
                *norms,
                rotate_query=True,
            )
            return q, None
        if norms:
            qk = kernels.fused.qk_rms_norm(qk, attention.num_heads, *norms, backend)
        q, k = self(qk).split([attention.num_heads, attention.num_kv_heads], dim=1)
        kernels.write_kv(
            k, v, attention.k_cache, attention.v_cache, slot_mapping, backend, attention.k_scale, attention.v_scale
        )
        return q, (k, v)


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up stacked into one projection."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        bias: bool,
        linear: LinearFactory,
        backend: str = "torch",
    ):
        super().__init__()
        self.backend = backend
        self.gate_up_proj = linear("gate_up_proj", hidden_size, [intermediate_size] * 2, bias, "column")
        self.down_proj = linear("down_proj", intermediate_size, [hidden_size], bias, "row")
        self.act_and_mul = ACTIVATIONS[hidden_act]

    def forward(self, x: torch.Tensor, lora: LoRAMetadata | None = None) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x, lora), self.backend), lora)


def prefixed(factory: LinearFactory | EmbeddingFactory, prefix: str) -> LinearFactory | EmbeddingFactory:
    """`factory` for the layers of a submodule: their checkpoint names start with `prefix`."""
    return lambda name, *args: factory(prefix + name, *args)


def rename_prefix(key: str, prefixes: dict[str, str]) -> str:
    """Checkpoint name `key` (a weight's or a module's) as the model names it: its first prefix in `prefixes` (a
    model's `checkpoint_prefixes`: the checkpoint's -> the model's) replaced."""
    old = next((p for p in prefixes if key.startswith(p)), None)
    return key if old is None else prefixes[old] + key[len(old) :]
