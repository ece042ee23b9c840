"""`tiffin batch run`: a batch file run offline on one model, as vLLM's `run-batch` does, through the same OpenAI
app and line checks as the server's Batch API (tiffin.plugin.openai.batches), without its store.

Invariants: every line is checked before any runs (a `custom_id` used twice refuses the file, with nothing run);
the output file holds one line per input line, answered or failed, in input order, in OpenAI's batch output
shape; at most `concurrency` lines run at once."""

import asyncio
from pathlib import Path

from fastapi import FastAPI
from tqdm import tqdm

from tiffin.plugin.openai.batch_store import error_record
from tiffin.plugin.openai.batches import call_app, check_line, output_record
from tiffin.plugin.openai.encoding import dumps


def read_lines(app: FastAPI, path: Path) -> list[tuple]:
    """Each non-empty line of `path`, checked: (custom_id, url, body JSON, error); ValueError for a custom_id
    used twice."""
    lines, seen = [], set()
    with open(path, "rb") as f:
        for number, text in enumerate(f, 1):
            if not text.strip():
                continue
            checked = check_line(text, app.state.router, 0)
            if checked[0] in seen:
                raise ValueError(f"{path}:{number}: custom_id {checked[0]!r} is used twice")
            seen.add(checked[0])
            lines.append(checked)
    return lines


async def run_batch(app: FastAPI, lines: list[tuple], output: Path, concurrency: int, progress: bool = True) -> int:
    """Run checked `lines` on `app`, writing each result to `output` as soon as those before it are written;
    returns how many failed."""
    slots, results, failed = asyncio.Semaphore(concurrency), {}, 0
    written = asyncio.Event()

    async def run(i: int, custom_id: str | None, url: str | None, body: str | None, error: dict | None) -> None:
        nonlocal failed
        async with slots:
            try:
                if error is None:
                    status, content = await call_app(app, url.removeprefix("/v1"), body.encode(), None)
                    record, ok = await asyncio.to_thread(output_record, custom_id, status, content), status == 200
                else:
                    record, ok = error_record(custom_id, error), False
            except Exception as e:  # the line fails alone
                record, ok = (
                    error_record(custom_id, {"code": "server_error", "message": f"{type(e).__name__}: {e}"}),
                    False,
                )
        failed += not ok
        results[i] = dumps(record) + b"\n"
        written.set()

    with open(output, "wb") as out, tqdm(total=len(lines), unit="line", disable=not progress) as bar:
        tasks = [asyncio.create_task(run(i, *line)) for i, line in enumerate(lines)]
        done = 0
        while done < len(lines):
            await written.wait()
            written.clear()
            while done in results:
                out.write(results.pop(done))
                done += 1
                bar.update()
        await asyncio.gather(*tasks)
    return failed
