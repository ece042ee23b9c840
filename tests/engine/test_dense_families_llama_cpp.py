"""Granite, SmolLM3 and OLMo 2 as llama.cpp's own `convert_hf_to_gguf.py` writes them (F32 and Q8_0), from the tiny
checkpoints of test_dense_families: tiffin's greedy tokens are llama-server's on the same file. F32: identical
for every prompt (and transformers' on the checkpoint). Q8_0: identical up to a step where either side's two best
tokens are within NEAR_TIE nats (llama.cpp quantizes activations to 8 bits against Q8_0 weights, tiffin's exact
mode keeps them float; on a random tiny model the two best tokens are often close).

The converter refuses a BPE tokenizer whose pre-tokenizer it does not know by hash, as the tiny checkpoints' made-up
one: it is told 'gpt-2' (the prompts go in as ids; the tokenizer takes no part). Skipped, saying why, without
llama.cpp (~/.cache/tiffin-peers/llama.cpp with build/bin/llama-server, or $TIFFIN_LLAMA_CPP_SRC; see
../shared/bench/setup-llamacpp.sh)."""

import math
import os
from pathlib import Path

import pytest
from references import reference_generate, spread_weights
from test_dense_families import ARCHS, TINY, VOCAB, prompts
from transformers import AutoConfig, AutoModelForCausalLM

from tiffin import LLM, SamplingParams
from tiffin.testing.llama_cpp import convert_hf_to_gguf, peer_env
from tiffin.testing.servers import Server, free_port
from tiffin.tiny import write_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

LLAMA_CPP = Path(os.environ.get("TIFFIN_LLAMA_CPP_SRC", Path.home() / ".cache/tiffin-peers/llama.cpp"))
SERVER = LLAMA_CPP / "build" / "bin" / "llama-server"
TOKENS, NEAR_TIE = 24, 0.5


@pytest.fixture(scope="module", params=["granite", "smollm3", "olmo2"])
def converted(request, tmp_path_factory):
    """(model_type, {outtype: the GGUF llama.cpp's converter wrote}, the transformers model)."""
    if not (SERVER.exists() and (LLAMA_CPP / "convert_hf_to_gguf.py").exists()):
        pytest.skip(f"no llama.cpp at {LLAMA_CPP} (convert_hf_to_gguf.py, build/bin/llama-server)")
    model_type, tmp = request.param, tmp_path_factory.mktemp(request.param)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **TINY, **ARCHS[model_type]))
    spread_weights(hf.float().eval(), 1.0, 0.5, 2.0)
    hf.save_pretrained(tmp / "hf")
    write_tokenizer(tmp / "hf", VOCAB, False, TINY["max_position_embeddings"])
    hf.generation_config.eos_token_id = None
    files = {}
    for outtype in ("f32", "q8_0"):
        files[outtype] = tmp / f"{outtype}.gguf"
        convert_hf_to_gguf(LLAMA_CPP, tmp / "hf", outtype, files[outtype])
    return model_type, files, hf


def llama_greedy(server: Server, ids: list[int]) -> tuple[list[int], list[dict[int, float] | None]]:
    """llama-server's greedy tokens and each one's top-2 logprobs: None where it reports none (it leaves out the
    tokens that end inside a UTF-8 character, as byte tokens of a random model often do)."""
    body = {"prompt": ids, "n_predict": TOKENS, "temperature": 0, "n_probs": 2, "return_tokens": True,
            "cache_prompt": False, "ignore_eos": True}  # fmt: skip
    out = server.http.post("/completion", json=body, timeout=120).json()
    reported, tops = iter(out["completion_probabilities"]), []
    pending = next(reported, None)
    for token in out["tokens"]:
        if pending is not None and pending["id"] == token:
            tops.append({t["id"]: t["logprob"] for t in pending["top_logprobs"]})
            pending = next(reported, None)
        else:
            tops.append(None)
    return out["tokens"], tops


def gap(top: dict[int, float] | None) -> float:
    """The top-2 gap; infinite where unreported (the other side's gap decides)."""
    if top is None:
        return math.inf
    best, second = sorted(top.values(), reverse=True)[:2]
    return best - second


def greedy_both(path: Path, batch: list[list[int]], tmp_path: Path) -> tuple[list, list]:
    """tiffin's greedy outputs (exact mode, top-2 logprobs) and llama-server's (tokens, top-2 logprobs) on `path`."""
    llm = LLM(str(path), dtype="float32", cpu_quant_compute="exact", max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=2)
    ours = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)]
    port = free_port()
    command = [str(SERVER), "-m", str(path), "-t", "2", "-np", "1", "-c", "256", "--port", str(port)]
    with Server(command, port, tmp_path / "llama-server.log", env=peer_env()) as server:
        server.wait("/health")
        return ours, [llama_greedy(server, p) for p in batch]


def divergences(ours: list, theirs: list) -> list[tuple[int, float, float]]:
    """(first differing step, tiffin's top-2 gap there, llama.cpp's) of each prompt whose tokens differ."""
    found = []
    for o, (tokens, tops) in zip(ours, theirs):
        split = next((i for i, (a, b) in enumerate(zip(o.token_ids, tokens)) if a != b), None)
        if split is not None:
            found.append((split, gap({t: v.logprob for t, v in o.logprobs[split].items()}), gap(tops[split])))
    return found


def assert_answers_as_llama_server(
    model_type: str,
    files: dict,
    outtype: str,
    hf,
    batch: list,
    tmp_path: Path,
    dequantized=None,
    one_identical: bool = True,
) -> None:
    """On the F32 file, llama-server's and transformers' (`hf`) greedy tokens; on the Q8_0 one, transformers' on
    `dequantized` (the file's weights, where given) and llama-server's up to near ties (and on at least one prompt
    exactly, with `one_identical`)."""
    ours, theirs = greedy_both(files[outtype], batch, tmp_path)
    if outtype == "f32":
        assert [o.token_ids for o in ours] == [t for t, _ in theirs]
        assert [o.token_ids for o in ours] == [reference_generate(hf, p, TOKENS)[0] for p in batch]
        return
    if dequantized is not None:
        assert [o.token_ids for o in ours] == [reference_generate(dequantized, p, TOKENS)[0] for p in batch]
    ties = divergences(ours, theirs)
    print(f"{model_type} Q8_0: {len(batch) - len(ties)}/{len(batch)} identical; (step, top-2 gaps) {ties}")
    assert all(min(gaps) < NEAR_TIE for _, *gaps in ties), ties
    assert not one_identical or len(ties) < len(batch)


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_llama_cpp_conversion_answers_as_llama_server(converted, outtype, tmp_path):
    model_type, files, hf = converted
    assert_answers_as_llama_server(model_type, files, outtype, hf, prompts()[:4], tmp_path)
