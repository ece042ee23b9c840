"""The Batch API through `bentoml serve` (issue #52): a 2,000-line batch of chat, completions and embeddings lines
with malformed ones among them, uploaded and run with the `openai` client beside 8 interactive chat streams, the
Bento killed with SIGKILL at `--kills` seeded random points and restarted each time, then hostile batch files.

One `bentoml serve tiffin.plugin.service:Tiffin` (default: the built-in tiny llama and tiny BERT, the embedding
lines served by the Bento's `embedding_model`; `--model /work/models/smol-Q4_K_M.gguf` for SmolLM2), priority
scheduling, `batch_dir` in a scratch folder:
  1. `--streams` (8) clients each send `--requests` streamed greedy chats one after the other: TTFT alone;
  2. the batch is uploaded (`files.create`) and created; once it runs, the same chats again: TTFT beside it, and
     the ratio of the p50s (the issue's goal: <= 1.5);
  3. at each of `--kills` (3) points, drawn with `--seed` between the lines recorded then and the end, the Bento
     and its workers get SIGKILL and a new Bento starts on the same batch_dir; what the killed one computed (its
     engine's finished-request counter, read from its Prometheus files) less what it recorded is what was in
     flight at the kill and is computed again: at most `batch_max_concurrency`;
  4. once completed: every custom_id once in the output and error files, errors exactly for the malformed lines,
     request_counts right, the last Bento computed exactly the generation lines not recorded before it started;
     every line that succeeded sent again live and compared (greedy: equal but for ids and times; embeddings within
     1e-5); a generation answered otherwise is sent live once more with logprobs: a failure unless the batch's
     token where the two part was within TIE_NATS of the live choice (a greedy tie that turns with how requests
     share a step);
  5. hostile files while chats stream back to back: a 100 MB upload past `batch_max_file_bytes` (64 MiB here), a
     file of 1e6 lines (past batch_max_lines), duplicate custom_ids; each refused (4xx) or failed with its code;
     the streams' longest gap between two chunks against the same streams alone; the batch_dir's and the server's
     temporary folder's bytes before and after.
It prints the figures and exits 1 when a check fails (never for a timing). The CPU is shared by whatever else runs:
compare figures of one run only.

    python benchmarks/batch_served.py
    python benchmarks/batch_served.py --model /work/models/smol-Q4_K_M.gguf --embedding-model tiffin-tiny-bert
    python benchmarks/batch_served.py --quick
    python benchmarks/batch_served.py --hostile-only   # step 5 alone
"""

import argparse
import asyncio
import json
import multiprocessing
import random
import sqlite3
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import aiohttp
import openai
from embeddings import cpu_name
from serve import percentile, sse_chunks

from tiffin.testing.servers import BentoServer

READY_TIMEOUT_S = 900
FINISHED = "tiffin_e2e_request_latency_seconds_count"
VECTOR_TOLERANCE = 1e-5
TIE_NATS = 0.01  # another summation order moves a logit by ~1e-6 in fp32; a wrong token is rarely this close
QUICK = dict(
    lines=80, streams=2, requests=1, max_tokens=32, stream_tokens=4, concurrency=1, kills=1, hostile_lines=60_000
)
TOPICS = ["the moon", "rivers", "coffee", "prime numbers", "bridges", "green tea", "old maps", "bread", "mountains"]
TASKS = ["Explain {}.", "Write a short poem about {}.", "List three facts about {}.", "What is the history of {}?"]


def batch_lines(n: int, models: tuple[str, str], max_tokens: int, seed: int) -> tuple[list, list[tuple]]:
    """`n` lines: chat, completions and embeddings in turn on seeded prompts, the malformed ones spread among them;
    and (custom_id or None where it has none, the error code expected) of each malformed line."""
    chat, embed = models
    rng, greedy = random.Random(seed), {"max_tokens": max_tokens, "temperature": 0}
    bad_body = {"model": chat, "prompt": "x", "max_tokens": "many"}
    malformed = [
        (None, "invalid_json", b'{"custom_id": "torn", "method": "POST"'),
        (None, "missing_custom_id", {"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}),
        ("bad-url", "invalid_url", {"url": "/v1/nope", "body": {"model": chat, "prompt": "x"}}),
        ("bad-model", "model_not_found", {"url": "/v1/completions", "body": {"model": "gpt-4o", "prompt": "x"}}),
        ("bad-stream", "invalid_body", {"url": "/v1/completions", "body": {"model": chat, "prompt": "x", "stream": 1}}),
        ("bad-method", "invalid_method", {"method": "GET", "url": "/v1/completions", "body": {"model": chat}}),
        ("bad-body", "400", {"url": "/v1/completions", "body": bad_body}),  # it runs, and the route answers 400
    ]
    lines: list = []
    for i in range(n - len(malformed)):
        ask = rng.choice(TASKS).format(rng.choice(TOPICS))
        kind = ("chat", "cmpl", "emb")[i % 3]
        if kind == "chat":
            url, body = "/v1/chat/completions", {"model": chat, "messages": [{"role": "user", "content": ask}]} | greedy
        elif kind == "cmpl":
            url, body = "/v1/completions", {"model": chat, "prompt": f"Line {i}. {ask}"} | greedy
        else:
            url, body = "/v1/embeddings", {"model": embed, "input": f"{i}: {ask}"}
        lines.append({"custom_id": f"{kind}-{i}", "method": "POST", "url": url, "body": body})
    for k, (custom_id, _, line) in enumerate(malformed):
        if isinstance(line, dict):
            line = {"custom_id": custom_id, "method": "POST"} | line if custom_id else line
        lines.insert(len(lines) * (k + 1) // (len(malformed) + 1), line)
    return lines, [(custom_id, code) for custom_id, code, _ in malformed]


def jsonl(lines: list) -> bytes:
    return b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines)


# ---- interactive streams ----


async def stream_chat(session, url: str, model: str, prompt: str, max_tokens: int) -> tuple[float, list[tuple]]:
    """(TTFT, (start, end) of each gap between two chunks: time.monotonic) of one streamed greedy chat."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    body |= {"temperature": 0, "ignore_eos": True, "stream": True}
    start, stamps = time.monotonic(), []
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"chat stream: HTTP {resp.status}: {(await resp.text())[:200]}")
        async for chunk in sse_chunks(resp):
            if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                stamps.append(time.monotonic())
    if not stamps:
        raise RuntimeError("chat stream: no content")
    return stamps[0] - start, list(zip(stamps, stamps[1:]))


async def streams(url: str, model: str, args, until=None) -> tuple[list, list]:
    """`args.streams` clients, each `args.requests` chats one after the other (or back to back until `until()`):
    (TTFTs, gaps between chunks as (start, end))."""
    ttfts, gaps = [], []

    async def client(i: int) -> None:
        r = 0
        while (r < args.requests) if until is None else not until():
            prompt = f"Client {i}, question {r}: tell me about {TOPICS[(i + r) % len(TOPICS)]}."
            ttft, chunk_gaps = await stream_chat(session, url, model, prompt, args.stream_tokens)
            ttfts.append(ttft)
            gaps.extend(chunk_gaps)
            r += 1

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(client(i) for i in range(args.streams)))
    return ttfts, gaps


# ---- the batch ----


def start(tmp: Path, settings: dict, n: int) -> tuple[BentoServer, openai.OpenAI]:
    (tmp / f"bento-{n}").mkdir()
    server = BentoServer(tmp / f"bento-{n}", args=settings, env={"TMPDIR": str(tmp / "spool")})
    server.wait("/readyz", 200, READY_TIMEOUT_S)
    return server, openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)


def recorded(batch_dir: Path, batch_id: str) -> tuple[int, int]:
    """(lines answered 200, generation lines among them) recorded for a running batch, read from its SQLite."""
    with sqlite3.connect(batch_dir / "batches.sqlite3") as db:
        return db.execute(
            "select count(*), coalesce(sum(url != '/v1/embeddings'), 0) from lines where batch_id = ? and ok = 1",
            (batch_id,),
        ).fetchone()


def wait_for(c: openai.OpenAI, batch_id: str, done=lambda b: b.status not in ("validating", "in_progress")):
    while not done(batch := c.batches.retrieve(batch_id)):
        time.sleep(0.1)
    return batch


def records(c: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [json.loads(r) for r in c.files.content(file_id).text.splitlines()] if file_id else []


def comparable(body: dict) -> dict:
    """What two answers to one greedy request share: all but ids and times (embeddings compared apart)."""
    return {k: v for k, v in body.items() if k not in ("id", "created", "data")}


def same(got: dict, live: dict) -> bool:
    """Two answers to one greedy request alike: all but ids and times equal, embeddings within VECTOR_TOLERANCE."""
    vectors = zip(got.get("data", []), live.get("data", []))
    close = all(max(abs(a - b) for a, b in zip(g["embedding"], v["embedding"])) <= VECTOR_TOLERANCE for g, v in vectors)
    return close and comparable(got) == comparable(live)


async def live_answers(url: str, lines: list[dict], concurrency: int) -> dict[str, dict]:
    """Each line sent live, `concurrency` at once: custom_id -> its answer (an error's body too)."""
    slots, answers = asyncio.Semaphore(concurrency), {}

    async def one(line: dict) -> None:
        async with slots, session.post(url + line["url"], json=line["body"]) as resp:
            answers[line["custom_id"]] = await resp.json()

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(one(line) for line in lines))
    return answers


def with_logprobs(line: dict) -> dict:
    """The line asking for each token's top alternatives too."""
    extra = {"logprobs": True, "top_logprobs": 5} if "chat" in line["url"] else {"logprobs": 5}
    return line | {"body": line["body"] | extra}


def live_tokens(answer: dict) -> list[tuple[str, dict[str, float]]]:
    """(token chosen, its top alternatives' logprobs with its own) at each step of a generation's answer."""
    logprobs = answer["choices"][0]["logprobs"]
    if "content" in logprobs:
        return [(x["token"], {t["token"]: t["logprob"] for t in x["top_logprobs"]}) for x in logprobs["content"]]
    return list(zip(logprobs["tokens"], logprobs["top_logprobs"]))


def text_of(answer: dict) -> str:
    choice = answer["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def tie_gap(batch_text: str, steps: list[tuple[str, dict[str, float]]]) -> float | None:
    """Where the batch's text leaves the live tokens: how far (nats) below the live choice the batch's own token
    lay live; None where the batch's token is not among the live top alternatives (or the texts never part)."""
    at = 0
    for chosen, top in steps:
        if batch_text.startswith(chosen, at):
            at += len(chosen)
            continue
        return min(
            (top[chosen] - lp for token, lp in top.items() if token and batch_text.startswith(token, at)), default=None
        )
    return None


def differences(url: str, lines: list[dict], answers: dict[str, dict], concurrency: int) -> tuple[list, dict]:
    """Each line sent again live: (custom_ids answered otherwise than in the batch, custom_id -> the logprob gap
    at the token where batch and live part, sent live once more with logprobs; None where no near-tie explains it).
    Greedy ties turn with how requests share a step (another GEMM shape sums in another order), live as well."""
    live = asyncio.run(live_answers(url, lines, concurrency))
    differ = [x for x in lines if not same(answers[x["custom_id"]], live[x["custom_id"]])]
    generations = [with_logprobs(x) for x in differ if "embeddings" not in x["url"]]
    explained = asyncio.run(live_answers(url, generations, concurrency))
    gaps = {x["custom_id"]: None for x in differ}
    for key, answer in explained.items():
        gaps[key] = tie_gap(text_of(answers[key]), live_tokens(answer))
    return [x["custom_id"] for x in differ], gaps


def kill_and_restart(server, c, tmp: Path, settings: dict, batch_id: str, args, chats: int) -> tuple:
    """Step 3: `args.kills` kills at points drawn with `args.seed` over the generation lines left now; `chats`: the
    requests besides batch lines the first server's engine finished. (The last server, its client, the generation
    lines recorded when it started, failed checks.)"""
    batch_dir, rng, failures = Path(settings["batch_dir"]), random.Random(args.seed), []
    total = args.generation_lines
    gen_before = 0
    _, gen_now = recorded(batch_dir, batch_id)
    for n, point in enumerate(sorted(rng.random() for _ in range(args.kills)), 1):
        target = gen_now + int(point * max(total - gen_now - args.concurrency, 0))
        while recorded(batch_dir, batch_id)[1] < target and c.batches.retrieve(batch_id).status == "in_progress":
            time.sleep(0.05)
        if c.batches.retrieve(batch_id).status != "in_progress":  # its lines have left SQLite
            failures.append(f"the batch ended before kill {n}: give it more lines or a lower --concurrency")
            break
        server.kill()
        ok, gen = recorded(batch_dir, batch_id)
        lost = server.stored_metrics()[FINISHED] - chats - (gen - gen_before)
        print(
            f"kill {n}: {gen} of {total} generation lines recorded ({ok} lines in all); {lost:g} finished by the "
            f"engine but not recorded (computed again)"
        )
        if not 0 <= lost <= args.concurrency:
            failures.append(f"kill {n}: {lost:g} lines finished but not recorded (bound {args.concurrency})")
        gen_before, chats = gen, 0
        server, c = start(tmp, settings, n)
    return server, c, gen_before, failures


def check_batch(c: openai.OpenAI, done, lines: list, malformed: list) -> tuple[dict, list[str]]:
    """Step 4 but the live answers: (custom_id -> body of each line answered 200, failed checks)."""
    out, err, failures = records(c, done.output_file_id), records(c, done.error_file_id), []
    got = sorted((r["custom_id"] for r in out + err), key=str)
    sent = sorted((x.get("custom_id") if isinstance(x, dict) else None for x in lines), key=str)
    if got != sent:
        failures.append(f"custom_ids: {len(got)} in the output and error files, {len(sent)} sent, or not each once")
    codes = [(r["custom_id"], r["error"]["code"] if r["error"] else str(r["response"]["status_code"])) for r in err]
    if sorted(codes, key=str) != sorted(malformed, key=str):
        failures.append(f"error file: {sorted(codes, key=str)}, expected {sorted(malformed, key=str)}")
    counts = {"total": len(lines), "completed": len(lines) - len(malformed), "failed": len(malformed)}
    if done.status != "completed" or done.request_counts.model_dump() != counts:
        failures.append(f"batch {done.status} with counts {done.request_counts}, expected {counts}")
    return {r["custom_id"]: r["response"]["body"] for r in out}, failures


# ---- hostile files ----


def disk(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def hostile_files(url: str, lines: int) -> list[tuple[str, bool, tuple[float, float]]]:
    """Step 5's files, one after the other (in a process of its own, so as not to slow the streams' client): (how
    each was answered, whether as it should be, when: time.monotonic); input files deleted. The long file's lines
    are short (`{"custom_id": ...}` alone), to stay under the upload limit."""
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    big, many = b"x" * (100 << 20), b"".join(b'{"custom_id": "h%d"}\n' % i for i in range(lines))
    line = {"method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 1}}
    twice = jsonl([{"custom_id": f"d{i % 2}"} | line for i in range(3)])
    started = time.monotonic()
    try:
        c.files.create(file=("big.jsonl", big), purpose="batch")
        answer, refused = "accepted", False
    except openai.APIStatusError as e:
        answer, refused = f"{e.status_code} {e.message}", 400 <= e.status_code < 500
    results = [(f"100 MB upload: {answer}", refused, (started, time.monotonic()))]
    long = f"{lines:,} lines ({len(many) / 1e6:.0f} MB)"
    for name, content, code in (
        (long, many, "too_many_requests"),
        ("duplicate custom_id", twice, "duplicate_custom_id"),
    ):
        started = time.monotonic()
        file = c.files.create(file=("hostile.jsonl", content), purpose="batch")
        batch = c.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
        batch = wait_for(c, batch.id)
        error = batch.errors.data[0] if batch.errors else None
        said = f"{name}: batch {batch.status}, {error and error.code} at line {error and error.line}"
        results.append((said, error is not None and error.code == code, (started, time.monotonic())))
        c.files.delete(file.id)
    return results


def hostile(server: BentoServer, model: str, args, tmp: Path, batch_dir: Path) -> tuple[list[str], list[str]]:
    """Step 5: the chat streams alone, then beside the hostile files: (lines to print, failed checks)."""
    _, alone = asyncio.run(streams(server.url, model, args))
    before = disk(batch_dir), disk(tmp / "spool")
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        sent = pool.submit(hostile_files, server.url, args.hostile_lines)
        _, beside = asyncio.run(streams(server.url, model, args, until=sent.done))
        results = sent.result()
    after = disk(batch_dir), disk(tmp / "spool")

    def longest(gaps: list, window: tuple[float, float] = (0, float("inf"))) -> str:
        return f"{max((b - a for a, b in gaps if b > window[0] and a < window[1]), default=0) * 1000:.0f} ms"

    said = [
        f"{line} in {w[1] - w[0]:.1f} s; streams' longest gap meanwhile {longest(beside, w)}" for line, _, w in results
    ]
    said.append(f"longest gap between two chunks of {args.streams} streams alone: {longest(alone)}")
    said.append(
        f"bytes of batch_dir {before[0]} before, {after[0]} after (input files deleted); of the server's TMPDIR "
        f"{before[1]} before, {after[1]} after"
    )
    return said, [f"hostile: {line}" for line, ok, _ in results if not ok]


def ttft_line(name: str, ttfts: list[float]) -> str:
    return f"TTFT {name}: p50 {percentile(ttfts, 50) * 1000:.1f} ms, p90 {percentile(ttfts, 90) * 1000:.1f} ms"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiffin-tiny-llama", help="the Bento's chat model (default: the tiny llama)")
    ap.add_argument("--embedding-model", default="tiffin-tiny-bert", help="the Bento's embedding_model")
    ap.add_argument("--setting", action="append", default=[], metavar="KEY=VALUE", help="another Bento setting")
    ap.add_argument("--lines", type=int, default=2000, help="lines of the batch, 7 of them malformed")
    ap.add_argument("--max-tokens", type=int, default=16, help="of each chat and completions line (greedy)")
    ap.add_argument("--concurrency", type=int, default=8, help="the Bento's batch_max_concurrency")
    ap.add_argument("--streams", type=int, default=8, help="interactive chat clients")
    ap.add_argument("--requests", type=int, default=4, help="chats each client sends, one after the other")
    ap.add_argument("--stream-tokens", type=int, default=16, help="tokens of each chat (ignore_eos)")
    ap.add_argument("--kills", type=int, default=3, help="SIGKILLs of the Bento at seeded random points")
    ap.add_argument("--hostile-lines", type=int, default=1_000_000, help="lines of the too-long hostile file")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help=f"a short run: {QUICK}")
    ap.add_argument("--hostile-only", action="store_true", help="step 5 alone (after a warm-up of the streams)")
    if ap.parse_args(argv).quick:
        ap.set_defaults(**QUICK)
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="batch-served-"))
    (tmp / "spool").mkdir()
    settings = {
        "model": args.model,
        "embedding_model": args.embedding_model,
        "scheduling_policy": "priority",
        "batch_dir": str(tmp / "batches"),
        "batch_max_concurrency": args.concurrency,
        "batch_max_file_bytes": 64 << 20,
    } | dict(item.split("=", 1) for item in args.setting)
    print(f"CPU: {cpu_name()}; Bento settings: {settings}")
    server, c = start(tmp, settings, 0)
    failures = []
    try:
        cards = server.http.get("/v1/models").json()["data"]
        chat = next(x["id"] for x in cards if "generate" in x["tasks"])
        embed = next(x["id"] for x in cards if "generate" not in x["tasks"] and "embed" in x["tasks"])
        if args.hostile_only:
            asyncio.run(streams(server.url, chat, args))  # warm-up
            said, failures = hostile(server, chat, args, tmp, Path(settings["batch_dir"]))
            print("\n".join(said))
            if failures:
                sys.exit("FAILED:\n" + "\n".join(failures))
            print("all checks passed")
            return
        lines, malformed = batch_lines(args.lines, (chat, embed), args.max_tokens, args.seed)
        args.generation_lines = sum(
            isinstance(x, dict) and x.get("custom_id", "")[:4] in ("chat", "cmpl") for x in lines
        )
        asyncio.run(streams(server.url, chat, args))  # warm-up
        alone, _ = asyncio.run(streams(server.url, chat, args))
        file = c.files.create(file=("batch.jsonl", jsonl(lines)), purpose="batch")
        started = time.monotonic()
        batch = c.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
        wait_for(c, batch.id, lambda b: b.status != "validating" and b.request_counts.completed >= args.concurrency)
        beside, _ = asyncio.run(streams(server.url, chat, args))
        print(ttft_line("alone ", alone))
        print(ttft_line("beside", beside))
        print(f"TTFT p50 beside the batch / alone: {percentile(beside, 50) / percentile(alone, 50):.2f} (goal <= 1.5)")
        chats = 3 * args.streams * args.requests
        server, c, gen_start, lost = kill_and_restart(server, c, tmp, settings, batch.id, args, chats)
        failures += lost
        done = wait_for(c, batch.id, lambda b: b.status in ("completed", "failed", "expired", "cancelled"))
        took = time.monotonic() - started
        computed = server.metrics()[FINISHED] - (0 if args.kills else chats)
        if computed != args.generation_lines - gen_start:
            failures.append(
                f"the last server computed {computed:g} generation lines, {args.generation_lines - gen_start} were left"
            )
        answers, wrong = check_batch(c, done, lines, malformed)
        failures += wrong
        print(f"batch {done.status} in {took:.0f} s with {args.kills} kills: {done.request_counts}")
        ok = [x for x in lines if isinstance(x, dict) and x.get("custom_id") in answers]
        differ, gaps = differences(server.url, ok, answers, args.concurrency)
        print(
            f"{len(ok)} lines sent again live: {len(differ)} answered otherwise {differ[:5]}; logprob gap where "
            f"batch and live part: { {k: v if v is None else round(v, 6) for k, v in gaps.items()} }"
        )
        if untied := sorted(k for k, gap in gaps.items() if gap is None or gap > TIE_NATS):
            failures.append(f"lines answered otherwise live, not at a near-tie (<= {TIE_NATS} nats): {untied[:5]}")
        said, wrong = hostile(server, chat, args, tmp, Path(settings["batch_dir"]))
        print("\n".join(said))
        failures += wrong
    finally:
        server.stop()
    if failures:
        sys.exit("FAILED:\n" + "\n".join(failures))
    print("all checks passed")


if __name__ == "__main__":
    main()
