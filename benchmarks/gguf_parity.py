"""GGUF files against llama.cpp and transformers on the same file, for what tiffin computes rather than how fast:
perplexity (`llama-perplexity`'s procedure: the text in chunks of `--ctx` tokens, each chunk's second half scored)
and greedy tokens (`llama-server`'s and transformers', from the same prompt tokens), with the near-ties at every
disagreement, and the weight memory against the file's tensor bytes. transformers dequantizes the file with gguf-py
and computes in fp32: the exact model the file holds; llama.cpp quantizes activations to 8 bits (per 32 inputs,
per 256 against K-quants), and tiffin's native kernels to 15.

    python benchmarks/gguf_parity.py --llama-cpp "$(../shared/bench/setup-llamacpp.sh)" FILE.gguf [FILE.gguf ...]

Without `--llama-cpp`, against transformers alone.

The text: the first `--ppl-tokens` tokens of Python's own documentation topics (as `kv_quant.py` measures),
written to a file for llama.cpp. The prompts: the README's (its chat question, `tiffin generate`'s two) and
`kv_quant.py`'s 16 chat questions, chat-templated where they are questions.
"""

import argparse
import json
import math
import re
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import torch
from common import markdown_table, peer_env
from kv_quant import QUESTIONS

from tiffin import LLM, SamplingParams
from tiffin.engine.core.scheduler import SchedulerOutput
from tiffin.engine.core.sequence import Sequence
from tiffin.engine.models.gguf_checkpoint import open_gguf

README_CHAT = "What is the capital of France?"
README_PROMPTS = ["Hello, tiffin", "The quick brown fox"]
NEAR_TIE = 0.1  # nats between the two likeliest tokens: a rounding may cross it


def prose_text(llm: LLM, tokens: int) -> str:
    from pydoc_data.topics import topics

    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode("\n\n".join(topics[k] for k in sorted(topics)), add_special_tokens=False)
    return tokenizer.decode(ids[:tokens])


@torch.inference_mode()
def chunked_perplexity(logits_of, ids: list[int], ctx: int) -> float:
    """llama-perplexity's: each whole chunk of `ctx` tokens in one forward (`logits_of(tokens)` -> `[ctx, vocab]`),
    the NLL of tokens ctx/2 + 1 .. ctx - 1 of each (a BOS first only where the model adds one; SmolLM2's does not)."""
    nll, count, first = 0.0, 0, ctx // 2
    for start in range(0, len(ids) - ctx + 1, ctx):
        tokens = ids[start : start + ctx]
        logprobs = logits_of(tokens)[first : ctx - 1].float().log_softmax(-1)
        nll -= float(logprobs.gather(1, torch.tensor(tokens[first + 1 :])[:, None]).sum())
        count += ctx - 1 - first
    return math.exp(nll / count)


def tiffin_logits(llm: LLM):
    runner = llm.llm_engine.model_runner

    def logits(tokens: list[int]) -> torch.Tensor:
        seq = Sequence("ppl", 0, tokens, SamplingParams(), 1)
        seq.block_table = list(range(-(-len(tokens) // runner.block_size)))
        step = SchedulerOutput()
        step.add(seq, len(tokens))
        inputs = runner.prepare(step)
        return runner.model.compute_logits(runner.model(inputs.input_ids, inputs.positions, inputs.attn))

    return logits


def transformers_model(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def transformers_greedy(model, ids: list[int], tokens: int) -> tuple[list[int], list[dict[int, float]]]:
    mask = torch.ones(1, len(ids), dtype=torch.long)
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=mask, max_new_tokens=tokens, do_sample=False,
                             output_scores=True, return_dict_in_generate=True)  # fmt: skip
    tops = []
    for scores in out.scores:
        top = scores[0].float().log_softmax(-1).topk(2)
        tops.append(dict(zip(top.indices.tolist(), top.values.tolist())))
    return out.sequences[0, len(ids) :].tolist(), tops


def llama_perplexity(binary: Path, gguf: Path, text: Path, args: argparse.Namespace) -> tuple[float, int]:
    """llama-perplexity's final estimate, and the chunks it scored."""
    ctx, threads = str(args.ctx), str(args.threads)
    out = subprocess.run(
        [str(binary), "-m", str(gguf), "-f", str(text), "-c", ctx, "-b", ctx, "-t", threads],
        capture_output=True, text=True, check=True, env=peer_env(),
    )  # fmt: skip
    log = out.stdout + out.stderr
    chunks = int(re.search(r"calculating perplexity over (\d+) chunks", log)[1])
    return float(re.search(r"Final estimate: PPL = ([0-9.]+)", log)[1]), chunks


def prompts(llm: LLM) -> list[tuple[str, list[int]]]:
    tokenizer = llm.get_tokenizer()
    chats = list(dict.fromkeys([README_CHAT, *QUESTIONS]))
    if tokenizer.chat_template is None:  # a file without one: the questions as text
        return [(p, tokenizer.encode(p, add_special_tokens=False)) for p in [*chats, *README_PROMPTS]]
    chat = lambda q: tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
    chat_ids = [ids if isinstance(ids, list) else ids["input_ids"] for ids in map(chat, chats)]
    plain = [(p, tokenizer.encode(p, add_special_tokens=False)) for p in README_PROMPTS]
    return [*zip(chats, chat_ids), *plain]


def gap(top: dict[int, float]) -> float:
    best, second = sorted(top.values(), reverse=True)[:2]
    return best - second


def llama_greedy(port: int, ids: list[int], tokens: int) -> tuple[list[int], list[dict[int, float]]]:
    body = {"prompt": ids, "n_predict": tokens, "temperature": 0, "n_probs": 2, "return_tokens": True,
            "cache_prompt": False, "ignore_eos": True}  # fmt: skip
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        out = json.load(response)
    tops = [{t["id"]: t["logprob"] for t in p["top_logprobs"]} for p in out["completion_probabilities"]]
    return out["tokens"], tops


def start_server(binary: Path, gguf: Path, port: int, threads: int) -> subprocess.Popen:
    server = subprocess.Popen(
        [str(binary), "-m", str(gguf), "-t", str(threads), "-np", "1", "-c", "4096", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=peer_env(),
    )  # fmt: skip
    for _ in range(600):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return server
        except OSError:
            time.sleep(0.2)
    server.kill()
    raise SystemExit("llama-server did not start")


def compare_greedy(
    llm: LLM, peers: dict[str, object], tokens: int, stops: set[int]
) -> tuple[dict[str, tuple[int, int]], list[str]]:
    """Per peer (name -> fn(ids, tokens) -> (tokens, top-2 logprobs each)): prompts whose tokens are tiffin's, and
    prompts diverging where neither's two best tokens are within NEAR_TIE; a note on each divergence. Tokens are
    compared up to tiffin's first end-of-generation token (`stops`): llama.cpp's ignore_eos bans those where tiffin
    and transformers generate them."""
    counts, notes = {name: [0, 0] for name in peers}, []
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=2)
    for prompt, ids in prompts(llm):
        ours = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
        end = next((i for i, t in enumerate(ours.token_ids) if t in stops), len(ours.token_ids))
        for name, greedy in peers.items():
            theirs, their_tops = greedy(ids, tokens)
            pairs = enumerate(zip(ours.token_ids[:end], theirs))
            split = next((i for i, (a, b) in pairs if a != b), None)
            if split is None:
                counts[name][0] += 1
                continue
            our_gap, their_gap = gap({t: v.logprob for t, v in ours.logprobs[split].items()}), gap(their_tops[split])
            counts[name][1] += min(our_gap, their_gap) >= NEAR_TIE
            notes.append(
                f"{name}, {prompt[:40]!r}: token {split}, top-2 gap {our_gap:.3f} (tiffin) / {their_gap:.3f} ({name})"
            )
    return {name: tuple(c) for name, c in counts.items()}, notes


def measure(path: Path, args: argparse.Namespace) -> tuple[dict[str, object], list[str]]:
    """One file's table row, and a note on each greedy divergence."""
    llm = LLM(str(path), dtype="float32")
    reference = transformers_model(path)
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as text:
        text.write(prose_text(llm, args.ppl_tokens))
        text.flush()
        ids = llm.get_tokenizer().encode(Path(text.name).read_text(), add_special_tokens=False)
        if args.llama_cpp:
            theirs, chunks = llama_perplexity(args.llama_cpp / "llama-perplexity", path, Path(text.name), args)
            if chunks != len(ids) // args.ctx:
                raise SystemExit(f"llama.cpp scored {chunks} chunks of the text, tiffin {len(ids) // args.ctx}")
    ours = chunked_perplexity(tiffin_logits(llm), ids, args.ctx)
    exact = chunked_perplexity(lambda tokens: reference(torch.tensor([tokens])).logits[0], ids, args.ctx)
    peers = {"transformers": lambda ids, n: transformers_greedy(reference, ids, n)}
    server = start_server(args.llama_cpp / "llama-server", path, args.port, args.threads) if args.llama_cpp else None
    try:
        if server is not None:
            peers["llama.cpp"] = lambda ids, n: llama_greedy(args.port, ids, n)
        greedy, divergences = compare_greedy(llm, peers, args.tokens, open_gguf(path).eos_token_ids())
    finally:
        if server is not None:
            server.kill()
    file_bytes = sum(t.n_bytes for t in open_gguf(path).header.tensors)
    total, weights = len(prompts(llm)), llm.llm_engine.weight_bytes
    row = {
        "file": path.name,
        "perplexity: tiffin": f"{ours:.4f}",
        "transformers": f"{exact:.4f} ({ours / exact - 1:+.2%})",
    }
    if args.llama_cpp:
        row["llama.cpp"] = f"{theirs:.4f} ({ours / theirs - 1:+.2%})"
    for name, (same, clean) in greedy.items():
        row[f"greedy = {name} (diverging at no near-tie)"] = f"{same}/{total} ({clean})"
    mib = lambda n: f"{n / 2**20:.1f}"
    row["weights / file tensors"] = f"{mib(weights)} / {mib(file_bytes)} MiB ({weights / file_bytes:.3f}x)"
    return row, [f"{path.name}: {note}" for note in divergences]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf", nargs="+", type=Path)
    ap.add_argument("--llama-cpp", type=Path, help="the folder of llama-perplexity and llama-server")
    ap.add_argument("--ppl-tokens", type=int, default=20_000)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=48, help="greedy tokens a prompt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--port", type=int, default=8089)
    args = ap.parse_args()
    rows, notes = [], []
    for path in args.gguf:
        row, divergences = measure(path, args)
        rows.append(row)
        notes += divergences
    print(markdown_table(rows))
    print("\n".join(notes))


if __name__ == "__main__":
    main()
