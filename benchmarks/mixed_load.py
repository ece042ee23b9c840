"""Mixed load through the Bento (issue #26): chat streams beside embedding requests on one server, both engines
on the same cores. Does every result stay what it is when served without the other load, does any KV block leak,
and how much slower do the chats stream while embeddings run?

One `bentoml serve tiffin.plugin.service:Tiffin` (default: SmolLM2-135M-Instruct and all-MiniLM-L6-v2, both from
PyPI) answers, after a warm-up, `--rounds` rounds of three phases:
  1. chat alone: `--chats` (32) streamed /v1/chat/completions at once, greedy, ignore_eos, `--max-tokens` (64)
     each, fixed prompts of varied length; per stream its text, TTFT and TPOT (time per output token after the
     first);
  2. embeddings alone: `--embeddings` (256) /v1/embeddings requests at once, one sentence each (seeded sentences
     of `--embedding-tokens` word-pieces from tests/embedding_sentences.py), base64 floats as the openai client
     asks; their vectors and requests/s;
  3. mixed: the same chat streams; once every one of them has streamed its first token, all the embedding
     requests at once, again and again back to back (a wave waits for the one before) until every chat has
     finished, so that the embeddings cover the chats' whole decode; the same records (embedding requests/s:
     those answered while the chats streamed, over that time).
A warm-up runs the chats once first, so that every phase finds their prompts in the prefix cache alike. Then it
checks that every chat's text in a mixed phase equals the same round's phase-1 text, every vector its first
round's phase-2 vector (max |diff| <= 1e-5), and that the chat engine holds no KV cache block once the traffic
ends (/metrics; the embedding engine exports no KV gauge, only its request counter, which must count every
embedding sent). It also reports, apart, how the texts of every phase compare with round 1's phase 1: greedy
text may turn where the prompts' prefills were batched differently as they arrived, embeddings or not. It prints
per round TPOT p50/p99 and TTFT p50 of the chats and embedding requests/s, and the ratio TPOT p50 mixed / alone
against the goal of 1.5x. It exits 1 when a check fails (never for a timing).

While chats run, an embedding step is held to `embedding_step_share` of a chat step's time (tiffin.engine.turns);
`--embedding-step-share 100` lets every embedding step take its whole token budget, to show what that buys.
The machine's load before (uptime) and the busiest other processes before and after are printed: on a small
machine anything else running moves every figure.

    python benchmarks/mixed_load.py                               # SmolLM2 + MiniLM, share 0.5, 3 rounds
    python benchmarks/mixed_load.py --embedding-step-share 100    # embedding steps never held
    python benchmarks/mixed_load.py --model tiffin-tiny-llama --embedding-model tiffin-tiny-bert --quick
"""

import argparse
import asyncio
import base64
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
import psutil
from common import markdown_table, parse_range
from embeddings import cpu_name
from serve import percentile, sse_chunks

from tiffin.testing.servers import BentoServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from embedding_sentences import benchmark_sentences  # noqa: E402  (it lives with the tests, which use it too)

READY_TIMEOUT_S = 900
VECTOR_TOLERANCE = 1e-5
QUICK = dict(chats=4, embeddings=16, max_tokens=8, rounds=1)

TASKS = [
    "Explain {} to a ten-year-old.",
    "Write a short poem about {}.",
    "List three facts about {}.",
    "What is the history of {}?",
    "Give me a recipe that involves {}.",
    "Describe {} in one paragraph, then summarize it in one sentence.",
    "Why do people care about {}?",
    "Write a dialogue between two friends arguing about {}.",
]
TOPICS = [
    "the moon",
    "rivers",
    "coffee",
    "prime numbers",
    "winter in a small village",
    "bridges",
    "the printing press",
    "green tea",
    "a lazy dog",
    "city trains",
    "the ocean at night",
    "old maps",
    "bread",
    "music in the morning",
    "mountains",
    "the first computers",
]


def chat_prompts(n: int, seed: int) -> list[str]:
    """`n` fixed user messages of varied length: an instruction about a topic, every third after notes (a seeded
    sentence of 8-128 word-pieces)."""
    notes = benchmark_sentences(n, seed=seed + 1, min_tokens=8, max_tokens=128)
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        ask = rng.choice(TASKS).format(rng.choice(TOPICS))
        prompts.append(f"Some notes: {notes[i]}\n\n{ask}" if i % 3 == 2 else ask)
    return prompts


# ---- clients ----


@dataclass
class Chat:
    error: str | None = None
    text: str = ""
    tokens: int = 0
    start: float = 0.0  # perf_counter when sent, at the first content, at the last byte
    first: float = 0.0
    end: float = 0.0

    @property
    def ttft(self) -> float:
        return self.first - self.start

    @property
    def tpot(self) -> float:
        return (self.end - self.first) / max(self.tokens - 1, 1)


@dataclass
class Wave:
    vectors: list[np.ndarray | None]
    errors: list[str]
    start: float
    end: float
    ends: list[float] = field(default_factory=list)  # perf_counter when each answer was read
    latencies: list[float] = field(default_factory=list)


async def chat(session, url: str, model: str, prompt: str, max_tokens: int, first_token: asyncio.Event) -> Chat:
    """One streamed chat; sets `first_token` when its first content arrives (or it ends without any)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    out, parts = Chat(start=time.perf_counter()), []
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return out
            async for chunk in sse_chunks(resp):
                if chunk.get("usage"):
                    out.tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices") or []:
                    if text := (choice.get("delta") or {}).get("content"):
                        if not parts:
                            out.first = time.perf_counter()
                            first_token.set()
                        parts.append(text)
    except aiohttp.ClientError as e:
        out.error = f"{type(e).__name__}: {e}"
        return out
    finally:
        first_token.set()
    out.end, out.text = time.perf_counter(), "".join(parts)
    if not parts or out.tokens != max_tokens:
        out.error = f"{out.tokens} of {max_tokens} tokens, text streamed: {bool(parts)}"
    return out


async def embed(session, url: str, model: str, sentence: str, encoding: str) -> tuple[np.ndarray | None, str, float]:
    """(vector or None, error, time sent) of one /v1/embeddings request with one input."""
    start = time.perf_counter()
    body = {"model": model, "input": sentence, "encoding_format": encoding}
    try:
        async with session.post(f"{url}/v1/embeddings", json=body) as resp:
            if resp.status != 200:
                return None, f"HTTP {resp.status}: {(await resp.text())[:200]}", start
            got = (await resp.json())["data"][0]["embedding"]
    except aiohttp.ClientError as e:
        return None, f"{type(e).__name__}: {e}", start
    if encoding == "base64":
        vector = np.frombuffer(base64.b64decode(got), dtype="<f4")
    else:
        vector = np.asarray(got, dtype=np.float32)
    return vector, "", start


async def wave(session, url: str, model: str, sentences: list[str], encoding: str) -> Wave:
    """Every sentence at once."""
    start, ends = time.perf_counter(), {}

    async def one(i: int, sentence: str):
        result = await embed(session, url, model, sentence, encoding)
        ends[i] = time.perf_counter()
        return result

    results = await asyncio.gather(*(one(i, s) for i, s in enumerate(sentences)))
    w = Wave([v for v, _, _ in results], [e for _, e, _ in results if e], start, time.perf_counter())
    w.ends = [ends[i] for i in range(len(sentences))]
    w.latencies = [ends[i] - sent for i, (v, _, sent) in enumerate(results) if v is not None]
    return w


def session() -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=READY_TIMEOUT_S)
    return aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))


@dataclass
class Phase:
    name: str
    chats: list[Chat] = field(default_factory=list)
    waves: list[Wave] = field(default_factory=list)
    client_cpu_s: float = 0.0
    overlap: str = ""  # mixed: how the embeddings covered the chats' decode

    def errors(self) -> list[str]:
        return [c.error for c in self.chats if c.error] + [e for w in self.waves for e in w.errors]

    def embeddings_per_s(self) -> float | None:
        """Embedding requests answered a second: beside chats, those answered while the chats streamed (from the
        first wave to the last chat's end), the ones after running alone."""
        if not self.waves:
            return None
        start = self.waves[0].start
        if not self.chats:
            return sum(len(w.vectors) for w in self.waves) / (self.waves[-1].end - start)
        last = max(c.end for c in self.chats)  # before `start` if the chats streamed all their text at once
        return sum(end <= last for w in self.waves for end in w.ends) / (last - start) if last > start else 0.0


async def run_phase(name: str, url: str, models: tuple[str, str], prompts, sentences, args) -> Phase:
    chat_model, embedding_model = models
    phase, cpu = Phase(name), time.process_time()
    async with session() as http:
        embeddings = lambda: wave(http, url, embedding_model, sentences, args.encoding_format)
        firsts = [asyncio.Event() for _ in prompts]
        chats = lambda: [
            asyncio.create_task(chat(http, url, chat_model, p, args.max_tokens, first))
            for p, first in zip(prompts, firsts)
        ]
        if name == "embeddings alone":
            phase.waves.append(await embeddings())
        elif name == "chat alone":
            phase.chats = await asyncio.gather(*chats())
        else:  # mixed: the embeddings once every chat streams, wave after wave until the chats end
            tasks = chats()
            for first in firsts:
                await first.wait()
            while True:
                phase.waves.append(await embeddings())
                if all(t.done() for t in tasks):
                    break
            phase.chats = [t.result() for t in tasks]
            fired, stopped = phase.waves[0].start, phase.waves[-1].end
            first_end, last_end = min(c.end for c in phase.chats), max(c.end for c in phase.chats)
            phase.overlap = (
                f"{len(phase.waves)} wave(s) of {len(sentences)} embeddings, the first "
                f"{1000 * (fired - max(c.first for c in phase.chats)):.0f} ms after the last chat's first token; "
                f"the chats ended {first_end - fired:.2f}-{last_end - fired:.2f} s after it, the last wave "
                f"{stopped - last_end:.2f} s after the last chat; "
                f"{sum(end <= last_end for w in phase.waves for end in w.ends)} answered while the chats streamed"
            )
    phase.client_cpu_s = time.process_time() - cpu
    return phase


# ---- the machine ----


def load_line() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} ({len(os.sched_getaffinity(0))} usable CPUs)"


def busy_processes(exclude: set[int], seconds: float = 1.0, at_least: float = 5.0) -> list[str]:
    """Other processes using at least `at_least` % of a CPU over `seconds`, the busiest first."""
    procs = [p for p in psutil.process_iter(["pid", "cmdline", "name"]) if p.pid not in exclude]
    for p in procs:
        try:
            p.cpu_percent(None)
        except psutil.Error:
            pass
    time.sleep(seconds)
    busy = []
    for p in procs:
        try:
            pct = p.cpu_percent(None)
        except psutil.Error:
            continue
        if pct >= at_least:
            cmd = " ".join(p.info["cmdline"] or [p.info["name"] or "?"])
            busy.append((pct, f"{pct:.0f}% pid {p.pid}: {cmd[:150]}"))
    return [line for _, line in sorted(busy, reverse=True)]


def ours() -> set[int]:
    """This process and every process it started (the Bento's)."""
    me = psutil.Process()
    return {me.pid} | {c.pid for c in me.children(recursive=True)}


def print_busy(when: str, exclude: set[int]) -> None:
    busy = busy_processes(exclude)
    print(f"other processes using >= 5% of a CPU {when}: {'none' if not busy else ''}")
    for line in busy[:8]:
        print(f"  {line}")


def metrics(server: BentoServer) -> dict[str, float]:
    """Every sample of /metrics summed by name (over labels and workers)."""
    sums: dict[str, float] = {}
    for line in server.http.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{")[0].split()[0]
            sums[name] = sums.get(name, 0.0) + float(line.split()[-1])
    return sums


def kv_blocks_after(server: BentoServer, gauge: str, settle_s: float = 5.0) -> float:
    """An engine's KV blocks in use once idle: the gauge is set after each step, so allow the last one."""
    deadline = time.monotonic() + settle_s
    while (used := metrics(server).get(gauge, 0.0)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return used


# ---- checks and the table ----


def ms(values: list[float], q: int) -> str:
    return f"{1000 * percentile(values, q):.1f}"


def row(round_: int, phase: Phase) -> dict[str, str]:
    tpot, ttft = [c.tpot for c in phase.chats], [c.ttft for c in phase.chats]
    rate = phase.embeddings_per_s()
    lat = [t for w in phase.waves for t in w.latencies]
    return {
        "round": str(round_),
        "phase": phase.name,
        "chats": str(len(phase.chats)) if phase.chats else "-",
        "embeddings": str(sum(len(w.vectors) for w in phase.waves)) if phase.waves else "-",
        "chat TPOT p50 ms": ms(tpot, 50) if tpot else "-",
        "chat TPOT p99 ms": ms(tpot, 99) if tpot else "-",
        "chat TTFT p50 ms": ms(ttft, 50) if ttft else "-",
        "embedding req/s": "-" if rate is None else f"{rate:.0f}",  # mixed: while the chats stream
        "embedding latency p50 ms": ms(lat, 50) if lat else "-",
        "client CPU s": f"{phase.client_cpu_s:.1f}",
    }


def text_differences(chats: list[Chat], reference: list[Chat]) -> tuple[int, str]:
    """How many chat texts differ from `reference`'s, and the first of them: where it turns."""
    differ = [i for i, (c, r) in enumerate(zip(chats, reference)) if c.text != r.text]
    if not differ:
        return 0, ""
    i = differ[0]
    got, want = chats[i].text, reference[i].text
    at = next((k for k, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))
    around = lambda text: repr(text[max(0, at - 20) : at + 40])
    return len(differ), f"#{i} from character {at}: {around(got)} vs {around(want)}"


def vector_differences(phase: Phase, reference: list[np.ndarray]) -> tuple[int, float]:
    """How many vectors of `phase` differ from `reference`'s by more than VECTOR_TOLERANCE, and the max |diff|."""
    diffs = [
        float(np.abs(v - r).max()) if v.shape == r.shape else float("inf")
        for w in phase.waves
        for v, r in zip(w.vectors, reference)
    ]
    return sum(d > VECTOR_TOLERANCE for d in diffs), max(diffs, default=0.0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="the chat model (the Bento's `model` setting); default: SmolLM2-135M-Instruct")
    ap.add_argument("--embedding-model", help="the Bento's `embedding_model`; default: all-MiniLM-L6-v2")
    ap.add_argument("--embedding-step-share", type=float, default=0.5, help="the Bento's setting (default 0.5)")
    ap.add_argument(
        "--setting", action="append", default=[], metavar="KEY=VALUE", help="another Bento setting (repeatable)"
    )
    ap.add_argument("--chats", type=int, default=32, help="chat streams at once")
    ap.add_argument("--embeddings", type=int, default=256, help="embedding requests at once, one input each")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens each chat streams (ignore_eos)")
    ap.add_argument("--embedding-tokens", type=parse_range, default=(8, 128), metavar="LO:HI")
    ap.add_argument("--encoding-format", choices=("base64", "float"), default="base64")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the three phases (the VM's speed drifts)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help=f"a short run: {QUICK}")
    if ap.parse_args(argv).quick:  # its sizes as defaults: what the command line sets still wins
        ap.set_defaults(**QUICK)
    args = ap.parse_args(argv)
    settings: dict[str, object] = {"embedding_step_share": args.embedding_step_share}
    if args.model:
        settings["model"] = args.model
    if args.embedding_model:
        settings["embedding_model"] = args.embedding_model
    for item in args.setting:
        key, sep, value = item.partition("=")
        if not sep:
            ap.error(f"--setting needs KEY=VALUE, got {item!r}")
        settings[key] = value

    prompts = chat_prompts(args.chats, args.seed)
    sentences = benchmark_sentences(args.embeddings, args.seed, *args.embedding_tokens)
    print(f"CPU: {cpu_name()}; before the run: {load_line()}")
    print_busy("before the run", ours())
    print(f"Bento settings: {settings}")
    tmp = Path(tempfile.mkdtemp(prefix="mixed-load-"))
    with BentoServer(tmp, args=settings) as server:
        print(f"starting the Bento (log: {server.log})", file=sys.stderr)
        server.wait("/readyz", 200, READY_TIMEOUT_S)
        cards = server.http.get("/v1/models").json()["data"]
        chat_model = next((c["id"] for c in cards if "generate" in c["tasks"]), None)
        embedding_model = next((c["id"] for c in cards if "generate" not in c["tasks"] and "embed" in c["tasks"]), None)
        if chat_model is None or embedding_model is None:
            sys.exit(f"the Bento serves {[(c['id'], c['tasks']) for c in cards]}: no chat and embedding model pair")
        models = (chat_model, embedding_model)
        print(f"chat model {chat_model}, embedding model {embedding_model}")
        # warm-up, not measured: the chats once (so that every phase finds their prompts in the prefix cache alike),
        # then embeddings and a mixed phase of a quarter of the load, on other prompts and sentences
        warm_prompts = chat_prompts(max(2, args.chats // 4), args.seed + 1000)
        warm_sentences = benchmark_sentences(max(4, args.embeddings // 4), args.seed + 1000, *args.embedding_tokens)
        warm_up = [("chat alone", prompts), ("embeddings alone", warm_prompts), ("mixed", warm_prompts)]
        for name, chats in warm_up:
            warm = asyncio.run(run_phase(name, server.url, models, chats, warm_sentences, args))
            if warm.errors():
                sys.exit(f"warm-up {name}: {len(warm.errors())} requests failed, e.g. {warm.errors()[0]}")
        embeddings_before = metrics(server).get("tiffin_embedding_requests_total", 0.0)

        rows, rounds, sent = [], [], 0
        for r in range(1, args.rounds + 1):
            rounds.append({})
            for name in ("chat alone", "embeddings alone", "mixed"):
                phase = asyncio.run(run_phase(name, server.url, models, prompts, sentences, args))
                rounds[-1][name] = phase
                rows.append(row(r, phase))
                sent += sum(len(w.vectors) for w in phase.waves)
                print(" ".join(f"{k}={v}" for k, v in rows[-1].items()), file=sys.stderr)
                if phase.errors():
                    sys.exit(f"round {r}, {name}: {len(phase.errors())} requests failed, e.g. {phase.errors()[0]}")
                if phase.overlap:
                    print(f"round {r} mixed: {phase.overlap}")
        kv_used = kv_blocks_after(server, "tiffin_kv_cache_blocks_used")
        embedding_kv_used = kv_blocks_after(server, "tiffin_embedding_kv_cache_blocks_used")
        embeddings_counted = metrics(server).get("tiffin_embedding_requests_total", 0.0) - embeddings_before
    print_busy("after the run", ours())

    print(
        f"\nMixed load, embedding_step_share {args.embedding_step_share:g}: {args.chats} chats x {args.max_tokens} "
        f"tokens, {args.embeddings} embeddings of {args.embedding_tokens[0]}-{args.embedding_tokens[1]} word-pieces "
        f"({args.encoding_format}), {args.rounds} round(s). Mixed: TTFT is before the embeddings start; embedding "
        f"req/s counts those answered while the chats streamed\n"
    )
    print(markdown_table(rows))
    print()
    problems = []
    # the check: each round's mixed phase against the same requests without embeddings, in the same server state
    mixed_differ = [(r, *text_differences(p["mixed"].chats, p["chat alone"].chats)) for r, p in enumerate(rounds, 1)]
    for r, n, example in mixed_differ:
        if n:
            problems.append(f"round {r}: {n} of {args.chats} mixed chat texts differ from chat alone's, {example}")
    total = sum(n for _, n, _ in mixed_differ)
    print(
        f"chat texts, mixed = the same round's chat alone: {'yes' if not total else 'NO'} ({total} of "
        f"{args.chats * args.rounds} differ)"
    )
    # the same without embeddings, run to run (prefix-cache hits from round 1's on, arrival order): not the check
    first = rounds[0]["chat alone"].chats
    later = [(r, name) for r in range(1, args.rounds + 1) for name in ("chat alone", "mixed")][1:]
    drift = [(r, name, *text_differences(rounds[r - 1][name].chats, first)) for r, name in later]
    print(
        f"chat texts = round 1's chat alone, every later phase: {sum(d[2] for d in drift)} of "
        f"{args.chats * len(drift)} differ" + "".join(f"; round {r} {name}: {n}, {ex}" for r, name, n, ex in drift if n)
    )
    reference = rounds[0]["embeddings alone"].waves[0].vectors
    bad, worst = 0, 0.0
    for p in rounds:
        for name in ("embeddings alone", "mixed"):
            n, diff = vector_differences(p[name], reference)
            bad, worst = bad + n, max(worst, diff)
    if bad:
        problems.append(f"{bad} vectors differ from round 1's embeddings alone by more than {VECTOR_TOLERANCE:g}")
    print(
        f"vectors = round 1's embeddings alone: max |diff| {worst:.2e} over {sent} vectors ({bad} past "
        f"{VECTOR_TOLERANCE:g})"
    )
    if kv_used or embedding_kv_used:
        problems.append(f"KV blocks held once idle: chat engine {kv_used:g}, embedding engine {embedding_kv_used:g}")
    if embeddings_counted != sent:
        problems.append(f"tiffin_embedding_requests_total rose by {embeddings_counted:g}, {sent} were sent")
    print(
        f"KV blocks used once idle: chat engine {kv_used:g}, embedding engine {embedding_kv_used:g} "
        f"(tiffin_embedding_requests_total rose by {embeddings_counted:g}, {sent} sent)"
    )
    tpot_p50 = lambda p: statistics.median(c.tpot for c in p.chats)
    ratios = [tpot_p50(p["mixed"]) / tpot_p50(p["chat alone"]) for p in rounds]
    median, each = statistics.median(ratios), ", ".join(f"{x:.2f}" for x in ratios)
    print(
        f"chat TPOT p50 mixed / alone: {median:.2f}x, the median of the rounds' ({each}); "
        f"goal <= 1.5x: {'met' if median <= 1.5 else 'missed'}"
    )
    for problem in problems:
        print(f"FAILED: {problem}")
    if problems:
        sys.exit(1)


if __name__ == "__main__":
    main()
