"""The fused decode-layer ops (kernels/fused.py, kernels/triton_fused.py) under Triton's interpreter, fp32 and fp16,
against plain torch written out here (not the dispatch's torch implementations, which they replace on a GPU):
RMSNorm with and without the residual add, SiLU- and GELU-and-mul, the rotary embedding (with and without Qwen3's
q/k RMSNorm before it) fused with the KV-cache write. The
kernels round where the unfused torch code rounds, so fp16 agrees to within one or two units in the last place
(only reduction orders differ). Every output buffer starts as NaN: an element left unwritten fails."""

import pytest
import torch

from tiffin import kernels
from tiffin.kernels import triton_common as tc

DTYPES = [torch.float32, torch.float16]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(tc, "empty", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype))


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    tol = TOLERANCE[want.dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [64, 96])  # 96: a block padded past the row
def test_rms_norm_and_add_rms_norm(dtype, width):
    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(3, width, generator=gen).to(dtype) * 3 for _ in range(2))
    weight = torch.randn(width, generator=gen).to(dtype)
    close(kernels.rms_norm(x, weight, 1e-5, "triton"), reference_rms_norm(x, weight, 1e-5))
    normed, new_residual = kernels.add_rms_norm(x, residual, weight, 1e-5, "triton")
    torch.testing.assert_close(new_residual, x + residual, rtol=0, atol=0)  # one rounding of the sum, as torch
    close(normed, reference_rms_norm(x + residual, weight, 1e-5))
    normed_torch, residual_torch = kernels.add_rms_norm(x, residual, weight, 1e-5, "torch")
    close(normed_torch, reference_rms_norm(x + residual, weight, 1e-5))
    assert torch.equal(residual_torch, x + residual)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    gen = torch.Generator().manual_seed(1)
    gate_up = torch.randn(2, 3, 2 * 48, generator=gen).to(dtype) * 4
    gate, up = gate_up[..., :48], gate_up[..., 48:]
    want = torch.nn.functional.silu(gate.float()).to(dtype) * up
    got = kernels.silu_and_mul(gate_up, "triton")
    assert got.shape == (2, 3, 48)
    close(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # g / (1 + inf) = -0: the intended far tail
def test_gelu_and_mul(dtype, approximate, backend):
    """Gates from -12 to 12 besides random ones: both tails of the tanh form, where a naive tanh would overflow
    or cancel."""
    gen = torch.Generator().manual_seed(3)
    gate_up = torch.randn(2, 3, 2 * 48, generator=gen).to(dtype) * 4
    gate_up[0, 0, :48] = torch.linspace(-12, 12, 48).to(dtype)
    gate, up = gate_up[..., :48], gate_up[..., 48:]
    want = torch.nn.functional.gelu(gate.float(), approximate=approximate).to(dtype) * up
    got = kernels.gelu_and_mul(gate_up, backend, approximate)
    assert got.shape == (2, 3, 48)
    close(got, want)


def reference_rotation(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Neox rotation from the angles themselves, in fp32: pairs (i, i + head_dim / 2) turn by position * freq."""
    angles = positions.float()[:, None, None] * inv_freq
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * angles.cos() - x2 * angles.sin(), x2 * angles.cos() + x1 * angles.sin()], -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["", "qk_norm"])
def test_rotary_write_kv(dtype, backend, qk_norm):
    """Two query heads, one KV head, head_dim 32 and 48 (halves of 24: a block padded past them); qk and v are
    views striding over one fused qkv row, as the model passes them; slot -1 is a padding row. With `qk_norm`
    each head is RMS-normalized by its own weight (query or key) before the rotation."""
    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, tokens, max_pos = 2, 1, 4, 50
    for head_dim in (32, 48):
        inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
        freqs = torch.arange(max_pos).float()[:, None] * inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype) * 3
        qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
        v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
        k_cache = torch.zeros(3, 4, kv_heads, head_dim, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        positions = torch.tensor([7, 0, 49, 3])
        slots = torch.tensor([5, 11, -1, 0])
        norms = [torch.randn(head_dim, generator=gen).to(dtype) for _ in "qk"] + [1e-6] if qk_norm else []
        args = (qk, v, k_cache, v_cache, slots, positions, cos, sin, heads, backend, None, None, *norms)
        q = kernels.rotary_write_kv(*args)
        normed = qk
        if qk_norm:
            q_weight, k_weight, eps = norms
            normed = torch.cat(
                [reference_rms_norm(qk[:, :heads], q_weight, eps), reference_rms_norm(qk[:, heads:], k_weight, eps)], 1
            )
        rotated = reference_rotation(normed, positions, inv_freq)
        close(q, rotated[:, :heads].to(dtype))
        flat_k, flat_v = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
        for token, slot in enumerate(slots.tolist()):
            if slot >= 0:
                close(flat_k[slot], rotated[token, heads:].to(dtype))
                assert torch.equal(flat_v[slot], v[token])
        written = {s for s in slots.tolist() if s >= 0}
        untouched = [s for s in range(flat_k.shape[0]) if s not in written]
        assert not flat_k[untouched].any() and not flat_v[untouched].any()  # the padding row wrote nowhere


def test_rotary_write_kv_refuses_one_norm_weight():
    qk, v, cache = torch.zeros(1, 2, 8), torch.zeros(1, 1, 8), torch.zeros(1, 1, 1, 8)
    rope, zero = torch.zeros(4, 4), torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="norm weights"):
        kernels.rotary_write_kv(qk, v, cache, cache.clone(), zero, zero, rope, rope, 1, "torch", None, None, rope[0])
