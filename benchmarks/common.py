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


def vocab_size(model_dir: str) -> int:
    """Random prompt token ids are drawn below this."""
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)["vocab_size"]


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
    a shared machine's free RAM) unless set, and none of the OpenMP defaults that importing tiffin set here."""
    import tiffin

    inherited = {k: v for k, v in os.environ.items() if k not in tiffin.ENV_SET_BY_TIFFIN}
    return {"VLLM_CPU_KVCACHE_SPACE": "1", **inherited}


def vllm_missing(python: str) -> str | None:
    """Why `python` cannot run vLLM (its import error), or None when it can."""
    try:
        proc = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True)
    except OSError as e:
        return f"{python}: {e.strerror}"
    return (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1] if proc.returncode else None
