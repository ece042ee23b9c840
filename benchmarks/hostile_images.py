"""Hostile images against a serving Bento of a tiny vision-language model (issue #49): while 8 text streams run,
each file of `tiffin.testing.hostile_images` (decompression bombs, truncated and corrupt files, wrong declared types,
animations of thousands of frames, huge and unparsable EXIF, palette tricks, the largest image max_image_pixels
allows) is sent `--repeat` times as a chat `image_url` data URL; prints, per file, the statuses, the slowest and
median answer, whether the 400's message names the problem, then the streams' longest gap (against the streams
alone) and the worker's RSS before and after (from /proc, through psutil). Exits 1 when a file gets a 5xx or
another status or message than expected; the issue's bar (each 400 within 1 s, RSS within 200 MB) is printed,
not enforced (timings depend on the host). The valid files (200s: the first frame of an animation, a palette PIL
reads, the largest image allowed) are answered with one token.

    python benchmarks/hostile_images.py [--repeat 3] [--frames 3000]

Writes a tiny random LLaVA checkpoint (`tiffin.testing.tiny_llava`) and starts `bentoml serve
tiffin.plugin.service:Tiffin` on it on a loopback port."""

import argparse
import base64
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from hostile import run_streams, worker_rss

from tiffin.testing.hostile_images import hostile_images
from tiffin.testing.servers import BentoServer
from tiffin.testing.tiny_llava import make_tiny_llava

RSS_BAR, SECONDS_BAR = 200 << 20, 1.0  # the bar


def chat_body(case) -> dict:
    url = f"data:{case.media_type};base64,{base64.b64encode(case.data).decode()}"
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is this?"}]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 1, "temperature": 0}


def send_all(server: BentoServer, cases: list, repeat: int) -> list[tuple]:
    """(case, [(status, seconds, error message)] * repeat) for each case, sent one after another."""
    out = []
    with httpx.Client(base_url=server.url, timeout=120) as http:
        for case in cases:
            answers = []
            for _ in range(repeat):
                started = time.monotonic()
                r = http.post("/v1/chat/completions", json=chat_body(case))
                message = r.json().get("error", {}).get("message", "") if r.status_code != 200 else ""
                answers.append((r.status_code, time.monotonic() - started, message))
            out.append((case, answers))
    return out


def report(results: list[tuple]) -> int:
    """Prints a markdown row per case; the number of cases answered otherwise than expected."""
    print("| file | KB | expected | statuses | slowest / median ms | problem named |")
    print("|---|---|---|---|---|---|")
    wrong = 0
    for case, answers in results:
        statuses = sorted({s for s, _, _ in answers})
        seconds = [t for _, t, _ in answers]
        named = all(all(w in m for w in case.words) for _, _, m in answers)
        ok = statuses == [case.status] and named
        wrong += not ok
        print(f"| {case.name} | {len(case.data) // 1024} | {case.status} | {', '.join(map(str, statuses))}"
              f"{'' if ok else ' WRONG'} | {max(seconds) * 1000:.0f} / {statistics.median(seconds) * 1000:.0f} | "
              f"{'yes' if named and case.words else '—' if named else 'NO: ' + answers[0][2][:80]} |")  # fmt: skip
    return wrong


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="times each file is sent")
    parser.add_argument("--frames", type=int, default=3000, help="frames of the animated GIF, APNG and WebP")
    args = parser.parse_args(argv)
    cases = hostile_images(args.frames)
    tmp = Path(tempfile.mkdtemp())
    model = make_tiny_llava(tmp / "tiny-llava")
    with BentoServer(tmp, args={"model": model, "num_kv_blocks": 512}) as server:
        server.wait("/readyz", 200, timeout=300)
        run_streams(server, 8)  # warm up
        send_all(server, cases[-1:], 1)  # and the image path, on the largest allowed image
        base_rss = worker_rss(server)
        clean_gap, _ = run_streams(server, 8)
        gap, results = run_streams(server, 8, lambda: send_all(server, cases, args.repeat))
        time.sleep(2)
        rss = worker_rss(server)
    wrong = report(results)
    fives = sum(s >= 500 for _, answers in results for s, _, _ in answers)
    slowest = {code: max(t for case, answers in results for _, t, _ in answers if case.status == code)
               for code in (400, 200)}  # fmt: skip
    print(f"\n{len(cases)} files x {args.repeat}: {fives} x 5xx, {wrong} answered otherwise than expected; slowest "
          f"400 {slowest[400] * 1000:.0f} ms ({'within' if slowest[400] <= SECONDS_BAR else 'PAST'} 1 s), slowest "
          f"200 {slowest[200] * 1000:.0f} ms")  # fmt: skip
    print(f"8 streams' longest gap: {clean_gap * 1000:.0f} ms alone, {gap * 1000:.0f} ms beside the files")
    print(f"worker RSS before {base_rss / 2**20:.0f} MiB, after {rss / 2**20:.0f} MiB ({(rss - base_rss) / 2**20:+.0f} "
          f"MiB: {'within' if rss - base_rss <= RSS_BAR else 'PAST'} 200 MB)")  # fmt: skip
    sys.exit(1 if wrong or fives else 0)


if __name__ == "__main__":
    main()
