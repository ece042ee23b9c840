"""What the benchmarks share: length ranges and name lists on the command line, seeded workloads of random
token ids, the model's vocabulary, the benchmark models, markdown tables, and how vLLM (the peer) is run.

The scripts run as `python benchmarks/<name>.py`, which puts this folder first on sys.path: `from common import`.
"""

import argparse
import json
import os
import random
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

import tiffin  # noqa: F401, I001  (before torch: it sets torch's OpenMP defaults)
from tiffin.testing.checkpoints import write_gguf_model  # noqa: F401 (the scripts' import)
from tiffin.testing.llama_cpp import peer_env  # noqa: F401 (the scripts' import)

# ---- the command line ----


def parse_range(text: str) -> tuple[int, int]:
    """`LO:HI`, or `N` for N:N; 1 <= LO <= HI."""
    try:
        lo, hi = (int(x) for x in text.split(":")) if ":" in text else (int(text),) * 2
    except ValueError:
        raise argparse.ArgumentTypeError(f"a length range is LO:HI or N, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"a length range needs 1 <= LO <= HI, got {text!r}")
    return lo, hi


def name_list(choices: Sequence[str], what: str) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated, non-empty list of `choices` (named `what` in the error)."""

    def parse(text: str) -> list[str]:
        names = [p.strip() for p in text.split(",") if p.strip()]
        unknown = [p for p in names if p not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {what}(s) {unknown or text!r}; choose from {', '.join(choices)}")
        return names

    return parse


# ---- workloads: prompts of random token ids, so that every engine gets the same ids and no tokenizer counts ----


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def max_len(self) -> int:
        return max(len(p) + k for p, k in zip(self.prompts, self.output_lens))


def random_tokens(rng: random.Random, n: int, vocab_size: int, low: int = 0) -> list[int]:
    return [rng.randrange(low, vocab_size) for _ in range(n)]


def _workload(rng: random.Random, lens: Sequence[tuple[int, int]], vocab_size: int) -> Workload:
    """One request per (prompt length, output length), its prompt drawn from `rng`."""
    return Workload([random_tokens(rng, p, vocab_size) for p, _ in lens], [k for _, k in lens])


def fixed_workload(lens: Sequence[tuple[int, int]], vocab_size: int, seed: int) -> Workload:
    """Given lengths (throughput.py's warm-up)."""
    return _workload(random.Random(seed), lens, vocab_size)


def uniform_workload(
    n: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int, seed: int
) -> Workload:
    """throughput.py's: prompt and output lengths uniform in their ranges (all lengths drawn before the prompts)."""
    rng = random.Random(seed)
    lens = [(rng.randint(*prompt_len), rng.randint(*output_len)) for _ in range(n)]
    return _workload(rng, lens, vocab_size)


def log_uniform_workload(
    n: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int, seed: int
) -> Workload:
    """serve.py's, ShareGPT-like: lengths log-uniform in their ranges (many short, a long tail); token ids from 4
    up, past the benchmark models' special tokens (tiffin.tiny.SPECIAL_TOKENS), which a server may treat apart."""
    rng = random.Random(seed)
    log_uniform = lambda lo, hi: round(lo * (hi / lo) ** rng.random())
    prompts, output_lens = [], []
    for _ in range(n):
        prompts.append(random_tokens(rng, log_uniform(*prompt_len), vocab_size, low=4))
        output_lens.append(log_uniform(*output_len))
    return Workload(prompts, output_lens)


def shared_prefix_prompts(n: int, prefix_len: int, suffix_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """prefix.py's: one prefix (a system prompt) shared by `n` prompts, each with its own suffix (a question)."""
    rng = random.Random(seed)
    prefix = random_tokens(rng, prefix_len, vocab_size)
    return [prefix + random_tokens(rng, suffix_len, vocab_size) for _ in range(n)]


def vocab_size(model: str) -> int:
    """Random prompt token ids are drawn below this: the vocabulary of a Hugging Face directory or a GGUF file."""
    from tiffin.engine.models.loader import get_model_config

    return get_model_config(model).vocab_size


# ---- the benchmark models ----

SHAPES = {  # 2,048 positions so that prefix.py's 1,050-token prompts fit
    "llama-40m": dict(
        hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, intermediate_size=1408
    ),
    "smollm2-135m": dict(  # SmolLM2-135M's config, random weights
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
        rope_theta=100000.0,
    ),
}


def make_model(path: str, shape: str = "llama-40m") -> Path:
    """A random Llama of a benchmark shape, tied embeddings."""
    from tiffin.tiny import make_tiny_model

    config = {"vocab_size": 32000, "tie_word_embeddings": True, "max_position_embeddings": 2048, **SHAPES[shape]}
    return make_tiny_model(path, arch="llama", **config)


def _rtn_groups(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest 4-bit codes of `w [out, in]` per group of `group` inputs, asymmetric: codes `[in, out]`,
    zeros and fp16 scales `[in / group, out]` (no calibration: weights to time the kernels on, not to ship)."""
    groups = w.float().T.reshape(-1, group, w.shape[0])  # [in / group, group, out]
    low, high = groups.amin(1), groups.amax(1)
    scales = ((high - low) / 15).clamp_min(1e-8).half()
    zeros = (-low / scales.float()).round().clamp(0, 15)
    codes = (groups / scales.float()[:, None] + zeros[:, None]).round().clamp(0, 15)
    return codes.reshape(w.shape[1], w.shape[0]).to(torch.int32), zeros.to(torch.int32), scales


def _pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """`[R, C]` codes -> AutoAWQ's `[R, C / 8]` int32 words (output column c in nibble AWQ_NIBBLE[c % 8])."""
    from tiffin.kernels.quant import AWQ_NIBBLE

    words = torch.zeros(codes.shape[0], codes.shape[1] // 8, dtype=torch.int64)
    for c, nibble in enumerate(AWQ_NIBBLE):
        words |= codes[:, c::8].to(torch.int64) << (4 * nibble)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def write_quantized(model_dir: str, out: str, method: str) -> str:
    """`model_dir`'s projections quantized, rounded to nearest (weights to time, not to ship), everything else copied;
    returns a description. `awq` / `gptq`: 4-bit (AWQ gemm; GPTQ's `gptq` format, no act-order) in groups of the
    largest of 128, 64, 32 inputs that divides every projection; `w8a8`: compressed-tensors int8 a channel with int8
    activations a token (llm-compressor's W8A8); `fp8-block`: e4m3 in 128 x 128 blocks (DeepSeek-V3's layout)."""
    import shutil

    from safetensors.torch import load_file, save_file

    tensors, packed = load_file(str(Path(model_dir) / "model.safetensors")), {}
    inputs = {t.shape[1] for name, t in tensors.items() if name.endswith("_proj.weight")}
    group = next(g for g in (128, 64, 32) if all(k % g == 0 for k in inputs))
    for name, t in tensors.items():
        module, _, kind = name.rpartition(".")
        if kind != "weight" or not module.endswith(("_proj",)):
            packed[name] = t
            continue
        packed |= {f"{module}.{key}": value for key, value in _QUANTIZERS[method](t, group).items()}
    Path(out).mkdir(parents=True, exist_ok=True)
    save_file(packed, str(Path(out) / "model.safetensors"), metadata={"format": "pt"})
    for file in Path(model_dir).iterdir():
        if file.name not in ("model.safetensors", "config.json"):
            shutil.copy(file, out)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    settings, described = _settings(method, group)
    (Path(out) / "config.json").write_text(json.dumps({**config, "quantization_config": settings}, indent=2))
    return described


def _awq(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    codes, zeros, scales = _rtn_groups(w, group)
    return {"qweight": _pack_awq(codes), "qzeros": _pack_awq(zeros), "scales": scales}


def _gptq(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    from tiffin.kernels.quant import pack_rows

    codes, zeros, scales = _rtn_groups(w, group)  # `gptq` stores zeros - 1
    return {"qweight": pack_rows(codes, 4), "qzeros": pack_rows((zeros - 1).T, 4).T.contiguous(), "scales": scales}


def _w8a8(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    scale = (w.float().abs().amax(1, keepdim=True) / 127).clamp_min(1e-12)
    codes = (w.float() / scale).round().clamp(-128, 127).to(torch.int8)
    return {"weight": codes, "weight_scale": scale.to(w.dtype)}


def _fp8_block(w: torch.Tensor, group: int, block: int = 128) -> dict[str, torch.Tensor]:
    n, k = w.shape
    padded = torch.nn.functional.pad(w.float(), (0, -k % block, 0, -n % block))
    scale = padded.view(padded.shape[0] // block, block, -1, block).abs().amax((1, 3)).clamp_min(1e-12) / 448
    full = scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return {"weight": (w.float() / full).clamp(-448, 448).to(torch.float8_e4m3fn), "weight_scale_inv": scale}


_QUANTIZERS = {"awq": _awq, "gptq": _gptq, "w8a8": _w8a8, "fp8-block": _fp8_block}


def _settings(method: str, group: int) -> tuple[dict, str]:
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm", "zero_point": True}, (
            f"awq 4-bit, group {group}"
        )
    if method == "gptq":
        settings = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": False}
        return {**settings, "checkpoint_format": "gptq"}, f"gptq 4-bit, group {group}"
    if method == "w8a8":
        int8 = lambda strategy, **more: {"num_bits": 8, "type": "int", "symmetric": True, "strategy": strategy, **more}
        scheme = {"targets": ["Linear"], "weights": int8("channel"), "input_activations": int8("token", dynamic=True)}
        settings = {"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"]}
        return {**settings, "config_groups": {"group_0": scheme}}, "w8a8 int8 (compressed-tensors)"
    settings = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    return settings, "fp8, 128x128 blocks"


# ---- output ----


def markdown_table(rows: Sequence[dict[str, object]]) -> str:
    """The rows under the first row's keys."""
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    return "\n".join(lines + ["| " + " | ".join(str(v) for v in r.values()) + " |" for r in rows])


# ---- vLLM, the peer ----


def vllm_engine_args(model: str, dtype: str, max_model_len: int, max_num_batched_tokens: int) -> dict[str, object]:
    """The settings every benchmark gives vLLM, as `vllm.LLM` keywords: the lengths and per-step token budget
    tiffin gets too, eager mode."""
    return {
        "model": os.path.abspath(model),
        "dtype": dtype,
        "max_model_len": max_model_len,
        "max_num_batched_tokens": max_num_batched_tokens,
        "enforce_eager": True,
    }


def vllm_flags(engine_args: dict[str, object]) -> list[str]:
    """The same settings as `vllm serve` flags."""
    flags = []
    for key, value in engine_args.items():
        flag = "--" + key.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags


def vllm_env() -> dict[str, str]:
    """vLLM's environment: a 1 GiB KV cache (the workloads need well under that; vLLM would otherwise size it from
    a shared machine's free RAM) unless set."""
    return {"VLLM_CPU_KVCACHE_SPACE": "1", **peer_env()}


def vllm_missing(python: str) -> str | None:
    """Why `python` cannot run vLLM (its import error), or None when it can."""
    try:
        proc = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True)
    except OSError as e:
        return f"{python}: {e.strerror}"
    return (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1] if proc.returncode else None
