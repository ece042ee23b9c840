"""`BatchStore`: the Batch API's files, batches and their lines, on disk under one directory (`batch_dir`).

Invariants:
- A file's bytes live in `files/<id>` (written to a temporary name, fsynced, then renamed), its record in SQLite
  (`batches.sqlite3`, WAL, synchronous=FULL: a committed transaction survives a kill -9 or a power cut).
- A batch's lines are copied into SQLite when it is validated; each line's result is written with the batch's
  counts in one transaction (`finish_line`), before the line counts as done, and a line holding a result is never
  given out to run again (`pending`). The lines leave SQLite once the output and error files are written.
- Everything is owned by the client (API key id) that made it; to anyone else it does not exist.
- One process per directory: an exclusive lock on `lock` is taken at open, and a second store on the same
  directory is refused (two servers would run the same batches twice).
- Calls block on disk: the event loop calls them through `asyncio.to_thread`; one lock serializes them. Work that
  grows with a file's lines goes `paced`, so that such a thread never starves the event loop of the GIL."""

import contextlib
import fcntl
import json
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from tiffin.plugin.openai.encoding import dumps

UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
SLICE = 256  # items (lines) a worker thread handles between two pauses: about 1-3 ms of parsing
MIN_PAUSE = 0.0005  # seconds
ROWS = 1000  # rows of one insert
T = TypeVar("T")
_SCHEMA = """
create table if not exists files (id text primary key, owner text, purpose text, obj text not null);
create table if not exists batches (
    id text primary key, owner text, obj text not null, total integer not null default 0,
    completed integer not null default 0, failed integer not null default 0);
create table if not exists lines (
    batch_id text not null, idx integer not null, custom_id text, url text, body text, result text, ok integer,
    primary key (batch_id, idx));
"""


def paced(items: Iterable[T], size: int = SLICE) -> Iterator[T]:
    """`items`, the thread sleeping after every `size` of them for as long as they took (wall time): a worker thread
    working through a large file so holds the GIL a slice at a time and at most half the time. Unpaced it holds it
    in the interpreter's 5 ms turns back to back, and the event loop, which gives the GIL up at each poll and send
    and then waits a turn to get it back, stalls every stream it serves for tens to hundreds of ms."""
    started = time.perf_counter()
    for i, item in enumerate(items, 1):
        yield item
        if i % size == 0:
            time.sleep(max(time.perf_counter() - started, MIN_PAUSE))
            started = time.perf_counter()


def nth_line(path: Path, n: int) -> int | None:
    """The number (from 1) of the `n`-th non-blank line of the file at `path`; None when it has fewer. Counted
    before anything is parsed, so that a file of a million lines is refused at the cost of reading `n` of them."""
    count = 0
    with open(path, "rb") as f:
        for number, text in paced(enumerate(f, 1), SLICE * 16):  # a line counted costs ~1/20 of one parsed
            if text.strip():
                count += 1
                if count == n:
                    return number
    return None


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}" if prefix != "file" else f"file-{uuid.uuid4().hex}"


class BatchStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        (self.root / "files").mkdir(parents=True, exist_ok=True)
        self._lock_file = open(self.root / "lock", "a")  # noqa: SIM115 (held for the store's life)
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise RuntimeError(f"batch_dir {self.root} is in use by another process") from None
        self._db = sqlite3.connect(self.root / "batches.sqlite3", check_same_thread=False, isolation_level=None)
        self._db.execute("pragma journal_mode=wal")
        self._db.execute("pragma synchronous=full")
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._db.close()
            self._lock_file.close()  # releases the flock

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One transaction, committed (durably) on leaving, rolled back on an exception."""
        with self._lock:
            self._db.execute("begin immediate")
            try:
                yield self._db
            except BaseException:
                self._db.execute("rollback")
                raise
            self._db.execute("commit")

    def _query(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # files

    def path(self, file_id: str) -> Path:
        return self.root / "files" / file_id

    def put_file(self, owner: str | None, obj: dict, chunks: Iterator[bytes]) -> dict:
        """Record the file `obj` (its `id` set; its `bytes` set here), its bytes written from `chunks`."""
        path = self.path(obj["id"])
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        obj["bytes"] = tmp.stat().st_size
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        with self._tx() as db:
            db.execute(
                "insert or replace into files values (?, ?, ?, ?)", (obj["id"], owner, obj["purpose"], dumps(obj))
            )
        return obj

    def get_file(self, owner: str | None, file_id: str) -> dict | None:
        rows = self._query("select obj from files where id = ? and owner is ?", (file_id, owner))
        return json.loads(rows[0][0]) if rows else None

    def list_files(self, owner: str | None, purpose: str | None = None) -> list[dict]:
        rows = self._query(
            "select obj from files where owner is ? and (? is null or purpose = ?) order by rowid desc",
            (owner, purpose, purpose),
        )
        return [json.loads(r[0]) for r in rows]

    def count_files(self, owner: str | None) -> int:
        """Files `owner` holds: uploads and batches' outputs."""
        return self._query("select count(*) from files where owner is ?", (owner,))[0][0]

    def delete_file(self, owner: str | None, file_id: str) -> bool:
        with self._tx() as db:
            deleted = db.execute("delete from files where id = ? and owner is ?", (file_id, owner)).rowcount
        if deleted:
            self.path(file_id).unlink(missing_ok=True)
        return bool(deleted)

    # batches

    def put_batch(self, owner: str | None, obj: dict) -> None:
        with self._tx() as db:
            db.execute("insert into batches (id, owner, obj) values (?, ?, ?)", (obj["id"], owner, dumps(obj)))

    def get_batch(self, owner: str | None, batch_id: str) -> dict | None:
        rows = self._query(
            "select obj, total, completed, failed from batches where id = ? and owner is ?", (batch_id, owner)
        )
        return _batch(rows[0]) if rows else None

    def list_batches(self, owner: str | None) -> list[dict]:
        rows = self._query(
            "select obj, total, completed, failed from batches where owner is ? order by rowid desc", (owner,)
        )
        return [_batch(r) for r in rows]

    def unfinished(self) -> list[tuple[str | None, dict]]:
        """(owner, batch) of every batch not yet in a final status, oldest first: what a restart resumes."""
        rows = self._query("select owner, obj, total, completed, failed from batches order by rowid")
        return [(r[0], b) for r in rows if (b := _batch(r[1:]))["status"] in UNFINISHED]

    def update_batch(self, batch_id: str, expect: tuple[str, ...] | None = None, **changes: Any) -> dict:
        """Set fields of the batch object (a status change stamps its `<status>_at` too), only while its status is
        one of `expect` when given; the batch after."""
        with self._tx() as db:
            row = db.execute("select obj, total, completed, failed from batches where id = ?", (batch_id,)).fetchone()
            obj = json.loads(row[0])
            if expect is None or obj["status"] in expect:
                obj |= changes
                if f"{changes.get('status')}_at" in obj:
                    obj[f"{changes['status']}_at"] = int(time.time())
                db.execute("update batches set obj = ? where id = ?", (dumps(obj), batch_id))
        return _batch((dumps(obj), *row[1:]))

    # lines

    def put_lines(self, batch_id: str, lines: list[tuple[int, str | None, str | None, str | None, str | None]]) -> bool:
        """The validated lines of a batch still validating, replacing any of an interrupted validation: (index,
        custom_id, url, body JSON to run, None), or (index, custom_id, None, None, the JSON of the error record that
        is its result). False, and nothing stored, when the batch left validating meanwhile (cancelled)."""
        rows = [(batch_id, *line, None if line[-1] is None else 0) for line in lines]
        failed = sum(1 for line in lines if line[-1] is not None)
        with self._tx() as db:
            (obj,) = db.execute("select obj from batches where id = ?", (batch_id,)).fetchone()
            if json.loads(obj)["status"] != "validating":
                return False
            db.execute("delete from lines where batch_id = ?", (batch_id,))
            _executemany(db, "insert into lines values (?, ?, ?, ?, ?, ?, ?)", rows)
            db.execute(
                "update batches set total = ?, completed = 0, failed = ? where id = ?", (len(lines), failed, batch_id)
            )
        return True

    def pending(self, batch_id: str) -> list[int]:
        """Indices of the lines without a result, in order."""
        rows = self._query("select idx from lines where batch_id = ? and result is null order by idx", (batch_id,))
        return [r[0] for r in rows]

    def line(self, batch_id: str, idx: int) -> tuple[str, str, str]:
        """(custom_id, url, body JSON) of a line to run."""
        return self._query("select custom_id, url, body from lines where batch_id = ? and idx = ?", (batch_id, idx))[0]

    def finish_line(self, batch_id: str, idx: int, result: dict, ok: bool) -> None:
        """Record a line's result and count it, in one transaction; a line already finished is left as it was."""
        with self._tx() as db:
            cur = db.execute(
                "update lines set result = ?, ok = ?, body = null where batch_id = ? and idx = ? and result is null",
                (dumps(result).decode(), int(ok), batch_id, idx),
            )
            if cur.rowcount:
                column = "completed" if ok else "failed"
                db.execute(f"update batches set {column} = {column} + 1 where id = ?", (batch_id,))

    def fail_pending(self, batch_id: str, error: dict) -> None:
        """Give every line still without a result the error `error` (the batch expired), in one transaction."""
        with self._tx() as db:
            rows = db.execute(
                "select idx, custom_id from lines where batch_id = ? and result is null", (batch_id,)
            ).fetchall()
            records = [(dumps(error_record(cid, error)).decode(), batch_id, idx) for idx, cid in paced(rows)]
            _executemany(db, "update lines set result = ?, ok = 0, body = null where batch_id = ? and idx = ?", records)
            db.execute("update batches set failed = failed + ? where id = ?", (len(rows), batch_id))

    def results(self, batch_id: str, ok: bool) -> Iterator[bytes]:
        """The recorded result lines of a batch that succeeded (`ok`) or failed, in input order, each ending in a
        newline; read in pages so that a large batch is never held whole."""
        after = -1
        while True:
            rows = self._query(
                "select idx, result from lines where batch_id = ? and ok = ? and idx > ? order by idx limit 1000",
                (batch_id, int(ok), after),
            )
            if not rows:
                return
            for _, result in rows:
                yield result.encode() + b"\n"
            after = rows[-1][0]

    def drop_lines(self, batch_id: str) -> None:
        with self._tx() as db:
            db.execute("delete from lines where batch_id = ?", (batch_id,))


def error_record(custom_id: str | None, error: dict) -> dict:
    """A line of an error file for a request that never ran (OpenAI's shape): `error` is {code, message}."""
    return {"id": new_id("batch_req"), "custom_id": custom_id, "response": None, "error": error}


def _batch(row: tuple) -> dict:
    obj, total, completed, failed = row
    return json.loads(obj) | {"request_counts": {"total": total, "completed": completed, "failed": failed}}


def _executemany(db: sqlite3.Connection, sql: str, rows: list[tuple]) -> None:
    """`db.executemany(sql, rows)`, `ROWS` rows at a time, paced."""
    for start in paced(range(0, len(rows), ROWS), 1):
        db.executemany(sql, rows[start : start + ROWS])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
