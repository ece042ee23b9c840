"""The Triton GEMMs on quantized activations (`triton_w8a8`): FP8 weights times e4m3 activations (sm_89 on), W8A8
weights times int8 activations (sm_80 on), and the activation quantizer both use.

Under the interpreter (which runs e4m3 and int8 `tl.dot`s: checked first, see `test_interpreter_dots`), at fp32 and
fp16 out (its bf16 dots are wrong; the quantizer reads bf16 correctly):
- the quantizer's codes and scales bit for bit torch's (`reference`'s; int8 symmetric: the CPU W8A8 path's own
  `quantize_tokens`), zero rows, saturating static scales and rows longer than one of its steps included;
- each GEMM against `reference` (its arithmetic in torch: integer or float64 products, the epilogue's fp32 products):
  INT8 bit for bit (unsplit), FP8 to fp32 summation order; M = 1, 3, 17, 70 (each tile), split-K, N and K not
  multiples of the tile; weight scales a tensor, a channel and 128 x 128 (64 x 64) blocks, K ragged against them;
- mutations fail: a scale changed, a block's scales transposed, a block-scaled weight read as a scale a row;
- `format_gemm`'s dispatch: FP8 decodes to x's dtype before sm_89 and dots e4m3 from there, W8A8 always int8.
What only a GPU can confirm: speed, and the hardware's e4m3 dot (products are exact, so only the fp32 summation
order may differ from the interpreter's); compile_check compiles every tile for sm_80 / sm_89 / sm_90 (the slow test
a sample) without spills.
The engine under the CUDA emulation (sm_90): compressed-tensors FP8 (static and dynamic) and W8A8 checkpoints,
greedy equal to transformers on the dequantized weights where its logits are not near-tied, decode graphed.
"""

import pytest
import torch
from compile_samples import assert_sample_compiles

from tiffin.kernels import block_gemm as bg
from tiffin.kernels import compile_check
from tiffin.kernels import triton_common as tc
from tiffin.kernels import triton_w8a8 as W8A8
from tiffin.kernels.block_layout import scale_run
from tiffin.quant.fp8 import quantize_rows as fp8_rows

ROWS = (1, 3, 17, 70)  # 70: the prefill tile
TOLERANCE = {torch.float32: 2e-6, torch.float16: 1e-3}  # relative to the output's largest: fp32 sums, x's dtype out


def _x(m: int, k: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-3, 4, (m, 1), generator=g).float())
    x[:, 5] += 7  # an outlier column, as activations have
    return x.to(dtype)


def fp8_weights(n: int, k: int, seed: int, block: tuple[int, int] | None = None, tensor: bool = False):
    """e4m3 weights with a scale a channel (a tensor), or a scale a `block` of (rows, inputs)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    if block is None:
        codes, d = fp8_rows(w)
        if tensor:
            d = d.amax().expand(n, 1)
            codes = (w / d).clamp(-448, 448).to(torch.float8_e4m3fn)
        return bg.pack_fp8(codes.view(torch.uint8), d.expand(n, k // 32).contiguous())
    rows, cols = block
    s = torch.rand(-(-n // rows), -(-k // cols), generator=g) + 0.5
    d = s.repeat_interleave(rows, 0)[:n].repeat_interleave(cols // 32, 1)[:, : k // 32]
    codes = (w * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    return bg.pack_fp8(codes.view(torch.uint8), d.contiguous())


def int8_weights(n: int, k: int, seed: int) -> bg.BlockWeights:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(1, 256, (n, k), generator=g, dtype=torch.uint8)  # signed -127..127, as int8 weights
    d = (torch.rand(n, 1, generator=g) * 0.01).half().float().expand(n, k // 32).contiguous()
    return bg.pack_codes(codes, d, -128 * d, 8, per_token=True)


def _gemm(x, w, zeros=False, splits=None, dtype=torch.float32):
    codes, scales, z = W8A8.quantize_rows(x, "fp8" if w.kind == bg.FP8 else "int8", w.input_scale, zeros)
    out = torch.full((x.shape[0], w.out_features), float("nan"), dtype=dtype)
    launch, partial = W8A8.w8a8_gemm_launch(codes, scales, z, w, out, splits)
    launch(x.device)
    return out, partial


def test_interpreter_dots(interpreter):
    """What the tests below stand on: the interpreter's int8 dot is exact and its e4m3 dot decodes every finite
    code (subnormals, both zeros) and sums in fp32."""
    import triton
    import triton.language as tl

    @triton.jit
    def dot(a_ptr, b_ptr, o_ptr, FP8: tl.constexpr):
        i, j = tl.arange(0, 16), tl.arange(0, 32)
        a = tl.load(a_ptr + i[:, None] * 32 + j[None, :])
        b = tl.load(b_ptr + j[:, None] * 16 + i[None, :])
        if FP8:
            o = tl.dot(a.to(tl.float8e4nv, bitcast=True), b.to(tl.float8e4nv, bitcast=True))
        else:
            o = tl.dot(a, b, out_dtype=tl.int32)
        tl.store(o_ptr + i[:, None] * 16 + i[None, :], o)

    g = torch.Generator().manual_seed(0)
    a, b = (torch.randint(-128, 128, s, generator=g, dtype=torch.int8) for s in [(16, 32), (32, 16)])
    out = torch.empty(16, 16, dtype=torch.int32)
    dot[(1,)](a, b, out, False)
    assert torch.equal(out, (a.long() @ b.long()).int())
    finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    a = finite[torch.randint(0, len(finite), (16, 32), generator=g)]
    for b in [torch.eye(32, 16, dtype=torch.float8_e4m3fn).view(torch.uint8), a.T.contiguous()]:
        fout = torch.empty(16, 16)
        dot[(1,)](a, b, fout, True)
        want = a.view(torch.float8_e4m3fn).double() @ b.view(torch.float8_e4m3fn).double()
        torch.testing.assert_close(fout.double(), want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_quantizer_fp8(interpreter, dtype):
    """Dynamic: `s = max(max|x| / 448, 2^-126)`, codes `e4m3(x / s)`; static: the given scale, saturating at 448.
    K = 1100: two of the quantizer's steps, the second partial; a row of zeros."""
    x = _x(5, 1100, seed=1, dtype=dtype)
    x[2] = 0
    codes, scales, zeros = W8A8.quantize_rows(x, "fp8")
    want_s = (x.float().abs().amax(1) / 448).clamp_min(2**-126)
    assert zeros is None and torch.equal(scales, want_s)
    assert torch.equal(codes, (x.float() / want_s[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8))
    static = torch.tensor([0.004])  # below max|x| / 448: the outliers saturate
    codes, scales, _ = W8A8.quantize_rows(x, "fp8", static)
    assert torch.equal(scales, static.expand(5))
    want = (x.float() / static).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(codes, want.view(torch.uint8)) and (want.float().abs() == 448).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_quantizer_int8(interpreter, dtype):
    """Symmetric: the CPU W8A8 path's `quantize_tokens`, bit for bit; asymmetric: `reference`'s zero points."""
    x = _x(5, 1100, seed=2, dtype=dtype)
    x[2] = 0
    x[3] = x[3].abs() + 1  # all positive: the range still holds 0
    codes, scales, zeros = W8A8.quantize_rows(x, "int8")
    want_q, want_s = bg.quantize_tokens(x)
    assert zeros is None and torch.equal(codes, want_q) and torch.equal(scales, want_s)
    codes, scales, zeros = W8A8.quantize_rows(x, "int8", zero_points=True)
    xf = x.float()
    s = (xf.amax(1).clamp_min(0) - xf.amin(1).clamp_max(0)) / 255
    inv = torch.where(s != 0, 1 / s, 0)
    z = -128 - (xf.amin(1).clamp_max(0) * inv).round()
    assert torch.equal(scales, s) and torch.equal(zeros, z.int())
    assert torch.equal(codes, ((xf * inv[:, None]).round() + z[:, None]).clamp(-128, 127).to(torch.int8))
    assert codes.min() == -128 and codes.max() == 127 and zeros[3] == -128  # the range used whole; 0 at -128


def test_quantizer_refuses_mismatched_options():
    x, s = torch.randn(2, 64), torch.ones(1)
    with pytest.raises(ValueError, match="static scale is for FP8"):
        W8A8.quantize_launch(x, torch.empty(2, 64, dtype=torch.int8), torch.empty(2), None, s)
    with pytest.raises(ValueError, match="zero points are for int8"):
        W8A8.quantize_launch(x, torch.empty(2, 64, dtype=torch.uint8), torch.empty(2), torch.empty(2), None)


# (N, K, weight scales, out dtype): N odd (groups of 16 rows padded, partial tiles), K = 192 (1.5 K steps of 128;
# ragged 128 blocks), 96 (under one step)
FP8_CASES = [
    (37, 192, "channel", torch.float32),
    (21, 96, "tensor", torch.float16),
    (37, 192, (128, 128), torch.float16),
    (50, 320, (64, 64), torch.float32),
]


def _fp8_case(n, k, scales, seed=0):
    if scales in ("channel", "tensor"):
        return fp8_weights(n, k, seed, tensor=scales == "tensor")
    return fp8_weights(n, k, seed, block=scales)


@pytest.mark.parametrize("n, k, scales, dtype", FP8_CASES, ids=[f"n{n}-k{k}-{s}-{d}" for n, k, s, d in FP8_CASES])
def test_fp8_gemm_is_its_reference(interpreter, n, k, scales, dtype):
    w = _fp8_case(n, k, scales)
    assert w.scale_inputs == (k if isinstance(scales, str) else scales[1])
    for m in ROWS:
        x = _x(m, k, seed=m)
        want = W8A8.reference(x, w)
        got, _ = _gemm(x, w, dtype=dtype)
        torch.testing.assert_close(got.float(), want, rtol=0, atol=TOLERANCE[dtype] * float(want.abs().max()))
    if k > 128:  # two K steps at least
        got, partial = _gemm(x, w, splits=2, dtype=dtype)
        assert partial is not None
        torch.testing.assert_close(got.float(), want, rtol=0, atol=TOLERANCE[dtype] * float(want.abs().max()))
    # and near the product on the dequantized weight: the reference is FP8's arithmetic, not another computation
    exact = x @ bg.dequantize_blocks(w).T
    assert (want - exact).abs().max() < 0.1 * exact.abs().max()


def test_fp8_gemm_static_scale(interpreter):
    w = fp8_weights(37, 192, seed=3)
    w.input_scale = torch.tensor([0.01])
    x = _x(3, 192, seed=3)
    want = W8A8.reference(x, w)
    torch.testing.assert_close(_gemm(x, w)[0], want, rtol=0, atol=2e-6 * float(want.abs().max()))
    w.input_scale = None
    assert not torch.allclose(W8A8.reference(x, w), want, rtol=1e-3)  # the static scale is what was applied


@pytest.mark.parametrize("zeros", [False, True], ids=["symmetric", "zero-points"])
def test_int8_gemm_is_its_reference_bit_for_bit(interpreter, zeros):
    """Unsplit, bit for bit `reference` (exact integer dots, `float(acc) * (s_x * d)`), symmetric activations also the
    CPU W8A8 path's `block_gemm_reference`; split-K sums the partials in fp32."""
    n, k = 37, 320
    w = int8_weights(n, k, seed=4)
    for m in ROWS:
        x = _x(m, k, seed=10 + m)
        x[0, 3] = -30  # a skewed row: its zero point far from the middle
        want = W8A8.reference(x, w, zero_points=zeros)
        got, _ = _gemm(x, w, zeros=zeros, splits=1)
        assert torch.equal(got, want), (got - want).abs().max()
        if not zeros:
            assert torch.equal(want, bg.block_gemm_reference(x, w, per_token=True))
        half, _ = _gemm(x, w, zeros=zeros, splits=1, dtype=torch.float16)
        assert torch.equal(half, want.half())
    got, partial = _gemm(x, w, zeros=zeros, splits=3)
    assert partial is not None
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * float(want.abs().max()))
    exact = x @ bg.dequantize_blocks(w).T
    assert (want - exact).abs().max() < 0.05 * exact.abs().max()


def test_mutations_fail(interpreter):
    """What the comparisons above catch: a block's scale changed, the block scales' grid transposed, a block-scaled
    weight read as a scale a row (the kernel's epilogue branch), the int8 zero-point correction dropped."""
    n, k = 128, 256
    x = _x(3, k, seed=5)
    w = fp8_weights(n, k, seed=5, block=(128, 128))
    got, _ = _gemm(x, w)
    close = lambda want: torch.allclose(got, want, rtol=0, atol=1e-4 * float(want.abs().max()))
    assert close(W8A8.reference(x, w))
    codes = bg.unpack_codes(w)
    d = bg.factors(w)[0]
    changed = d.clone()
    changed[:, 4:8] *= 1.25  # the second 128-block's scale
    transposed = d.view(n, 2, 4)[:, [1, 0]].reshape(n, 8)  # the 1 x 2 grid of a 128-row band read the other way
    for mutated in (changed, transposed):
        assert not close(W8A8.reference(x, bg.pack_fp8(codes, mutated.contiguous())))
    w.scale_inputs = k
    assert not close(_gemm(x, w)[0])
    wi = int8_weights(37, 320, seed=6)
    xi = _x(3, 320, seed=6) + 1
    assert not torch.allclose(_gemm(xi, wi, zeros=True)[0], W8A8.reference(xi, wi, zero_points=False), rtol=1e-3)


def test_dispatch_by_capability(interpreter, monkeypatch):
    """`format_gemm` on the Triton backend: FP8 decodes the weight to x's dtype before sm_89 (`dequantized_gemm`'s
    product) and dots e4m3 from sm_89; W8A8 dots int8 on every arch; the torch backend stays the dequantized
    product."""
    wf, wi = fp8_weights(37, 192, seed=7), int8_weights(37, 192, seed=7)
    x = _x(3, 192, seed=7)
    dequantized = lambda w: bg.dequantized_gemm_torch(x, w)
    for arch in (80, 86, 89, 90, 120):
        monkeypatch.setattr(tc, "arch", lambda device, a=arch: a)
        assert W8A8.fp8_dots(x.device) == (arch >= 89)
    for arch, fp8_want in [(86, dequantized(wf)), (89, W8A8.reference(x, wf))]:
        monkeypatch.setattr(tc, "arch", lambda device, a=arch: a)
        got = bg.format_gemm(x, wf, "triton")
        torch.testing.assert_close(got, fp8_want, rtol=0, atol=2e-6 * float(fp8_want.abs().max()))
        assert torch.equal(bg.format_gemm(x, wi, "triton"), W8A8.reference(x, wi))
    assert not torch.allclose(dequantized(wf), W8A8.reference(x, wf), rtol=0, atol=1e-4 * float(got.abs().max()))
    assert torch.equal(bg.format_gemm(x, wf, "torch"), dequantized(wf))
    assert torch.equal(bg.format_gemm(x, wi, "torch"), dequantized(wi))


def test_scale_run():
    """Inputs along a row sharing each FP8 scale, from the per-block scales (what picks the epilogue)."""
    d = torch.rand(5, 1).expand(5, 6)
    assert scale_run(d) == 192
    assert scale_run(torch.rand(5, 2).repeat_interleave(4, 1)[:, :6]) == 128
    assert scale_run(torch.rand(5, 3).repeat_interleave(2, 1)) == 64
    assert scale_run(torch.rand(5, 6)) == 32


# ---- compile check -------------------------------------------------------------------------------------------


def test_compile_check_registers_w8a8_cases():
    """FP8's cases only from sm_89; INT8's (both activation kinds) on every arch; each GEMM's decode tile whole and
    split-K, the mid and prefill tiles."""
    for arch, fp8 in [(80, False), (86, False), (89, True), (90, True), (120, True)]:
        configs = {case.config for _, case in compile_check.collect(arch, ["w8a8_gemm"])}
        assert any(c.startswith("fp8 128-blocks bfloat16 tile=16x64x128 split-K") for c in configs) == fp8
        assert any(c.startswith("quantize float16 fp8 static") for c in configs) == fp8
        assert "int8 zeros float16 tile=128x128x64" in configs and "quantize bfloat16 int8 zeros" in configs


SAMPLE_FP8 = ["fp8 128-blocks bfloat16 tile=16x64x128 split-K", "fp8 128-blocks float16 tile=128x128x64"]
SAMPLE_INT8 = ["int8 zeros float16 tile=128x128x64", "quantize bfloat16 int8 zeros"]


@pytest.mark.slow
@pytest.mark.subprocess
def test_compile_check_compiles_w8a8_sample():
    """FP8 for sm_89 and sm_90, INT8 for sm_80 and sm_90, without spills (all: `python -m
    tiffin.kernels.compile_check --kernels w8a8_gemm --arch 80,86,89,90,120`)."""
    assert_sample_compiles(["w8a8_gemm"], SAMPLE_FP8, archs=(89, 90))  # sm_89: 128 K steps spilled there
    assert_sample_compiles(["w8a8_gemm"], SAMPLE_INT8, archs=(80, 90))


# ---- the engine under the CUDA emulation -----------------------------------------------------------------------

NEAR_TIE = 0.01  # logits (nats) within which the reference's top tokens count as tied
ENGINE_SCHEMES = ["fp8-block", "w8a8-int"]  # e4m3 per token against 64 x 64 weight blocks, int8 per token


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from compressed_checkpoints import write_compressed

    from tiffin.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("w8a8")
    base = make_tiny_model(root / "base", vocab_size=512, num_hidden_layers=1, hidden_size=128, intermediate_size=192)
    return {name: write_compressed(base, root / name, name) for name in [*ENGINE_SCHEMES, "fp8-tensor"]}


@pytest.fixture
def sm90(monkeypatch):
    from tiffin.engine.worker import model_runner
    from tiffin.testing.cuda_emulation import CudaEmulation

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(model_runner, "warm_up_triton", lambda runner: None)
    with CudaEmulation(capability=(9, 0)) as emulation:
        yield emulation


def _reference_logits(path, name: str, quantize_inputs: bool):
    """transformers on the dequantized weights; with `quantize_inputs`, each quantized linear's input quantized and
    dequantized first as the format means it (compressed-tensors' own forward): e4m3 per token or of the static
    `input_scale`, int8 per token."""
    from compressed_checkpoints import QUANTIZED
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path / "reference", dtype=torch.float32).eval()
    static = {k.removesuffix(".input_scale"): v.float() for k, v in load_file(path / "model.safetensors").items()
              if k.endswith(".input_scale")}  # fmt: skip

    def fake_quantize(module_name, args):
        x = args[0].float()
        if name.startswith("w8a8"):
            q, d = bg.quantize_tokens(x.reshape(-1, x.shape[-1]))
            return ((q.float() * d[:, None]).view_as(x),)
        s = static.get(module_name)
        if s is None:
            s = (x.abs().amax(-1, keepdim=True) / 448).clamp_min(2**-126)
        return ((x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s,)

    if quantize_inputs:
        for module_name, module in hf.named_modules():
            if module_name.rsplit(".", 1)[-1] in QUANTIZED:
                module.register_forward_pre_hook(lambda mod, args, n=module_name: fake_quantize(n, args))
    return lambda ids: hf(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("name", ENGINE_SCHEMES)
def test_engine_greedy_matches_the_reference(sm90, checkpoints, name):
    """On an emulated sm_90, decode graphed, the activation-quantizing GEMMs in every quantized layer: each greedy
    token is the top token of transformers on the dequantized weights with the format's activation quantization
    (teacher-forced on the engine's text), or within NEAR_TIE of it; against the dequantized weights alone (no
    activation quantization) the engine's tokens stay within what that quantization moves the logits."""
    from tiffin import LLM, SamplingParams

    path = checkpoints[name]
    llm = LLM(str(path), device="cuda", dtype="float32", num_kv_blocks=16, max_num_seqs=1, max_model_len=32)
    assert sorted(llm.llm_engine.model_runner.decode_graphs.graphs) == [1]
    prompts = [torch.randint(4, 512, (7,), generator=torch.Generator().manual_seed(len(name))).tolist()]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    replays = sm90.replays
    sm90.reset_counts()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert sm90.replays - replays == 4 and {"_quantize_rows_kernel", "_w8a8_gemm_kernel"} <= set(sm90.launches)
    assert "_block_gemm_kernel" not in sm90.launches  # no layer decoded its weight
    gaps = {}
    for quantize_inputs in (True, False):
        logits_of = _reference_logits(path, name, quantize_inputs)
        gaps[quantize_inputs] = []
        for prompt, out in zip(prompts, outs):
            tokens = list(out.outputs[0].token_ids)
            with torch.inference_mode():
                logits = logits_of(prompt + tokens)[len(prompt) - 1 : -1]
            gaps[quantize_inputs] += [float(logits[i].max() - logits[i, t]) for i, t in enumerate(tokens)]
    assert max(gaps[True]) <= NEAR_TIE, gaps
    assert max(gaps[False]) <= 1.0, gaps  # FP8 / int8 activations: a random tiny model's logits move ~0.1-0.6


def _held_input_scales(path) -> dict:
    from tiffin.engine.models.linear import Linear
    from tiffin.engine.models.loader import build_model, get_model_config

    config = get_model_config(path)
    config.dtype = torch.float32
    model = build_model(config, path, torch.device("cpu"), 64, "torch", quant_backend="torch")
    layers = [(name, getattr(m, "blocks", None)) for name, m in model.named_modules() if isinstance(m, Linear)]
    return {name: blocks.input_scale for name, blocks in layers if blocks is not None}


def test_static_input_scales_load(checkpoints):
    """A static FP8 checkpoint (compressed-tensors' FP8 preset): each layer holds the largest `input_scale` of its
    shards (q/k/v and gate/up share an input, so theirs are one), for the GEMM's activations; a dynamic one none."""
    from safetensors.torch import load_file

    path = checkpoints["fp8-tensor"]
    scales = {k: v.float() for k, v in load_file(path / "model.safetensors").items() if k.endswith("input_scale")}
    assert len(scales) == 7
    held = _held_input_scales(path)
    assert len(held) == 4
    prefix = "model.layers.0."
    want = lambda *names: torch.stack([scales[f"{prefix}{n}.input_scale"] for n in names]).amax().view(1)
    assert torch.equal(
        held[prefix + "self_attn.qkv_proj"], want("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    )
    assert torch.equal(held[prefix + "mlp.gate_up_proj"], want("mlp.gate_proj", "mlp.up_proj"))
    assert torch.equal(held[prefix + "mlp.down_proj"], want("mlp.down_proj"))
    assert all(scale is None for scale in _held_input_scales(checkpoints["fp8-block"]).values())


def test_block_fp8_static_activation_scheme():
    """`quant_method: fp8` with `activation_scheme: static` reads each layer's `input_scale`; dynamic drops it."""
    from tiffin.quant.fp8 import FP8Config

    static = FP8Config.from_config({"quant_method": "fp8", "activation_scheme": "static"}, "test")
    assert "input_scale" in static.linear_method("model.layers.0.mlp.down_proj", "triton").needed
    dynamic = FP8Config.from_config({"quant_method": "fp8", "activation_scheme": "dynamic"}, "test")
    method = dynamic.linear_method("model.layers.0.mlp.down_proj", "triton")
    assert "input_scale" not in method.needed and "input_scale" in method.ignored


def test_asymmetric_w8a8_activations_load(checkpoints, tmp_path):
    """A W8A8 checkpoint whose activations are asymmetric (`input_activations.symmetric: false`) marks its layers
    for zero points a token (the Triton INT8 GEMM's); symmetric ones do not."""
    import json
    import shutil

    from tiffin.engine.models.linear import Linear
    from tiffin.engine.models.loader import build_model, get_model_config

    path = shutil.copytree(checkpoints["w8a8-int"], tmp_path / "asym")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"]["symmetric"] = False
    (path / "config.json").write_text(json.dumps(config))
    for source, zeros in [(checkpoints["w8a8-int"], False), (path, True)]:
        model_config = get_model_config(source)
        model_config.dtype = torch.float32
        model = build_model(model_config, source, torch.device("cpu"), 64, "torch", quant_backend="torch")
        blocks = [m.blocks for m in model.modules() if isinstance(m, Linear) and getattr(m, "blocks", None)]
        assert len(blocks) == 4 and all(b.per_token and b.input_zero_points == zeros for b in blocks)
