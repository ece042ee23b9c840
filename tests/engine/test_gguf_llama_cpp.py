"""SmolLM2-135M requantized by llama.cpp's own `llama-quantize` to IQ4_XS, IQ4_NL, Q3_K_M and Q2_K (and Q2_K with
--pure: on SmolLM2, whose 576 inputs are no whole super-blocks, the Q2_K mix puts Q3_K in ffn_down and Q2_K
nowhere, --pure puts it there): tiffin keeps every tensor quantized, within 1.1x the file's tensor bytes, and its
greedy tokens (the native kernels, the default) are llama-server's, up to a step where either side's two best
tokens are within NEAR_TIE nats (how many prompts match throughout is printed: 0-3 of 5 here, at 32 tokens). The
margin is wide because llama.cpp quantizes activations to 8 bits (per 32 inputs, per 256 against K-quants and
IQ4_XS), tiffin to 15: on the K-quant files of benchmarks/README.md the two engines part at gaps up to 0.44 nats
(llama.cpp's) where tiffin and transformers (the file's exact model) agree. And the SmolLM2 file's tokenizer (its
`smollm` pre-tokenizer) gives llama-server's ids.

Skipped, saying why, without llama.cpp (~/.cache/tiffin-peers/llama.cpp/build/bin, or $TIFFIN_LLAMA_CPP: see
../shared/bench/setup-llamacpp.sh) or a SmolLM2 GGUF to requantize (/work/models/smol-Q6_K.gguf, else the Q4_1 of
`tiffin.smollm2` when cached). The requantized files are cached in ~/.cache/tiffin/requantized. Without llama.cpp,
tests/engine/test_gguf.py's low-bit mix checks the same types against transformers."""

import collections
import os
from pathlib import Path

import pytest

from tiffin import LLM, SamplingParams
from tiffin.cache import default_cache_dir
from tiffin.engine.models.gguf_checkpoint import open_gguf
from tiffin.engine.models.source import load_tokenizer
from tiffin.smollm2 import MEMBER
from tiffin.testing.llama_cpp import peer_env, run_peer
from tiffin.testing.servers import Server, free_port

pytestmark = pytest.mark.slow

LLAMA_CPP = Path(os.environ.get("TIFFIN_LLAMA_CPP", Path.home() / ".cache/tiffin-peers/llama.cpp/build/bin"))
SOURCES = [Path("/work/models/smol-Q6_K.gguf"), default_cache_dir() / Path(MEMBER).name]
# file -> (llama-quantize's type and flags, the types of interest it must hold, kept quantized)
FILES = {
    "IQ4_XS": (["IQ4_XS"], {"IQ4_XS", "IQ4_NL"}),
    "IQ4_NL": (["IQ4_NL"], {"IQ4_NL"}),
    "Q3_K_M": (["Q3_K_M"], set()),  # Q4_0, Q5_0, Q5_1, Q4_K, Q5_K on SmolLM2's shapes
    "Q2_K": (["Q2_K"], {"Q3_K"}),
    "Q2_K-pure": (["--pure", "Q2_K"], {"Q2_K"}),
}
CHAT = ["What is the capital of France?", "Name three primary colors.", "What is 2 + 2?"]
PLAIN = ["Hello, tiffin", "The quick brown fox"]
TOKENS = 32
NEAR_TIE = 0.5  # nats between the two likeliest tokens: within 8-bit activations' reach


def requantized(name: str) -> Path:
    binary = LLAMA_CPP / "llama-quantize"
    if not (binary.exists() and (LLAMA_CPP / "llama-server").exists()):
        pytest.skip(f"no llama.cpp build at {LLAMA_CPP} (llama-quantize, llama-server): set TIFFIN_LLAMA_CPP")
    source = next((s for s in SOURCES if s.exists()), None)
    if source is None:
        pytest.skip(f"no SmolLM2 GGUF to requantize ({', '.join(map(str, SOURCES))})")
    path = default_cache_dir() / "requantized" / f"{source.stem}-{name}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        *flags, qtype = FILES[name][0]
        tmp = path.with_suffix(".part")
        run_peer([binary, "--allow-requantize", *flags, source, tmp, qtype, "2"])
        tmp.rename(path)
    return path


def prompt_ids(llm: LLM) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) for q in CHAT]
    chats = [ids if isinstance(ids, list) else ids["input_ids"] for ids in chats]
    return chats + [tokenizer.encode(p, add_special_tokens=False) for p in PLAIN]


def llama_greedy(server: Server, ids: list[int]) -> tuple[list[int], list[dict[int, float]]]:
    body = {"prompt": ids, "n_predict": TOKENS, "temperature": 0, "n_probs": 2, "return_tokens": True,
            "cache_prompt": False, "ignore_eos": True}  # fmt: skip
    out = server.http.post("/completion", json=body, timeout=300).json()
    return out["tokens"], [{t["id"]: t["logprob"] for t in p["top_logprobs"]} for p in out["completion_probabilities"]]


def gap(top: dict[int, float]) -> float:
    best, second = sorted(top.values(), reverse=True)[:2]
    return best - second


@pytest.mark.parametrize("name", FILES)
def test_requantized_smollm2_answers_as_llama_cpp(name, tmp_path):
    path = requantized(name)
    llm = LLM(str(path), dtype="float32", max_model_len=512)
    kept = llm.llm_engine.model_config.quant_config.kept
    header = open_gguf(path).header
    in_file = collections.Counter(t.qtype.name for t in header.tensors if len(t.dims) == 2)
    assert collections.Counter(kept.values()) == in_file  # every 2-D tensor kept, none dequantized
    assert FILES[name][1] <= set(kept.values())
    file_bytes = sum(t.n_bytes for t in header.tensors)
    assert llm.llm_engine.weight_bytes <= 1.1 * file_bytes, (llm.llm_engine.weight_bytes, file_bytes)

    # one thread: llama.cpp's spinning workers collapse beside busy processes (benchmarks/README.md)
    command = [str(LLAMA_CPP / "llama-server"), "-m", str(path), "-t", "1", "-np", "1", "-c", "2048"]
    port = free_port()
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=2)
    stops = open_gguf(path).eos_token_ids()
    same, ties = 0, []
    with Server([*command, "--port", str(port)], port, tmp_path / "llama-server.log", env=peer_env()) as server:
        server.wait("/health")
        for ids in prompt_ids(llm):
            ours = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
            theirs, their_tops = llama_greedy(server, ids)
            # compared up to tiffin's first end of generation: llama.cpp's ignore_eos bans those tokens
            end = next((i for i, t in enumerate(ours.token_ids) if t in stops), len(ours.token_ids))
            split = next((i for i, (a, b) in enumerate(zip(ours.token_ids[:end], theirs)) if a != b), None)
            if split is None:
                same += 1
                continue
            ties.append((split, gap({t: v.logprob for t, v in ours.logprobs[split].items()}), gap(their_tops[split])))
    print(
        f"{path.name}: {same}/{len(CHAT) + len(PLAIN)} prompts identical; (token, top-2 gaps tiffin, llama.cpp) {ties}"
    )
    assert all(min(gaps) < NEAR_TIE for _, *gaps in ties), ties


def test_smollm2_tokenizes_as_llama_cpp(tmp_path):
    """The file's `smollm` pre-tokenizer (digits split off first), which transformers' conversion drops: tiffin's
    ids are llama-server's on text with whitespace before digits, as in indented code and tables."""
    source = next((s for s in SOURCES if s.exists()), None)
    if source is None or not (LLAMA_CPP / "llama-server").exists():
        pytest.skip(f"no llama-server at {LLAMA_CPP} or no SmolLM2 GGUF ({', '.join(map(str, SOURCES))})")
    text = "def f(a=2):\n    return (2,)\n\n>>> f(1)\n   12 345\t6\n  7.5e-3  x1 0x1F\n日本 2024年 €9,99  \n\n"
    ours = load_tokenizer(str(source)).encode(text, add_special_tokens=False)
    command = [str(LLAMA_CPP / "llama-server"), "-m", str(source), "-t", "1", "-np", "1", "-c", "256"]
    port = free_port()
    with Server([*command, "--port", str(port)], port, tmp_path / "llama-server.log", env=peer_env()) as server:
        server.wait("/health")
        theirs = server.http.post("/tokenize", json={"content": text, "add_special": False}).json()["tokens"]
    assert ours == theirs
