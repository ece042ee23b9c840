"""Servers in subprocesses, for the tests and the benchmarks: a command serving HTTP on a loopback port, waited
on until a URL answers, then stopped with every process it started.

    with BentoServer(tmp, args={"model": "tiffin-tiny-llama"}) as server:
        server.wait("/readyz")
        server.http.post("/v1/completions", json=...)
"""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Self

import httpx
import psutil

# The folder that holds the tiffin package (the repository, in a checkout): the Bento's working directory.
SOURCE_ROOT = Path(__file__).resolve().parents[2]
TIFFIN_SERVICE = "tiffin.plugin.service:Tiffin"


def free_port() -> int:
    """A port that is free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_status(url: str) -> int:
    """The status `url` answers a GET with; 0 while nothing listens."""
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.TransportError:
        return 0


def wait_for(url: str, code: int = 200, timeout: float = 180, failed: Callable[[], str | None] = lambda: None) -> None:
    """Poll `url` until it answers `code`; raise once `timeout` seconds pass or `failed()` gives a reason to stop
    (a server that exited will never answer)."""
    deadline = time.monotonic() + timeout
    while http_status(url) != code:
        reason = failed() or (f"not within {timeout:g} s" if time.monotonic() > deadline else None)
        if reason:
            raise RuntimeError(f"{url} never answered {code}: {reason}")
        time.sleep(0.2)


class Server:
    """`command` serving HTTP on 127.0.0.1:`port` in a session of its own, its output in `log`; `env` is its whole
    environment (None: this process's)."""

    FATAL: str | None = None  # a line in the log after which the server never answers, though it may not exit

    def __init__(
        self,
        command: Sequence[str],
        port: int,
        log: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.port, self.url, self.log = port, f"http://127.0.0.1:{port}", Path(log)
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                list(command), cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.http = httpx.Client(base_url=self.url, timeout=30)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def status(self, path: str) -> int:
        return http_status(self.url + path)

    def wait(self, path: str, code: int = 200, timeout: float = 180) -> None:
        """Until `path` answers `code`; raises with the log's tail if the server exits or fails first."""
        try:
            wait_for(self.url + path, code, timeout, self._failed)
        except RuntimeError as e:
            raise RuntimeError(f"{e}; server log:\n{self.log.read_text(errors='replace')[-4000:]}") from None

    def _failed(self) -> str | None:
        if self.proc.poll() is not None:
            return f"the server exited with {self.proc.returncode}"
        if self.FATAL and self.FATAL in self.log.read_text(errors="replace"):
            return f"the server logged {self.FATAL!r}"
        return None

    def stop(self, grace: float = 20) -> None:
        """SIGTERM, then, after at most `grace` seconds, SIGKILL to every process the server had started: a
        Bento's workers run in process groups of their own. Stopping a stopped server does nothing."""
        self.http.close()
        family = []
        if self.proc.poll() is None:  # once reaped, its pid may be another process's
            try:
                main = psutil.Process(self.proc.pid)
                family = [main, *main.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
        for p in family:
            try:
                p.kill()  # psutil refuses a pid that was reused meanwhile
            except psutil.NoSuchProcess:
                pass
        self.proc.wait(5)


def bento_command(
    port: int, target: str = TIFFIN_SERVICE, args: Mapping[str, object] | None = None, working_dir: Path = SOURCE_ROOT
) -> list[str]:
    """`bentoml serve target` on 127.0.0.1:`port`, with each of `args` as `--arg key=value`."""
    bentoml = Path(sys.executable).parent / "bentoml"
    cmd = [str(bentoml), "serve", target, "--host", "127.0.0.1", "--port", str(port), "--working-dir", str(working_dir)]
    for key, value in (args or {}).items():
        cmd += ["--arg", f"{key}={value}"]
    return cmd


class BentoServer(Server):
    """A Bento on a free port, with a scratch BentoML home and log under `tmp`; no TIFFIN_* variable of the
    caller's environment leaks in besides `env`, so that a test sees only its own settings."""

    FATAL = "Application startup failed"

    def __init__(
        self,
        tmp: Path,
        target: str = TIFFIN_SERVICE,
        args: Mapping[str, object] | None = None,
        env: Mapping[str, str] | None = None,
        working_dir: Path = SOURCE_ROOT,
    ) -> None:
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("TIFFIN_")}
        full_env.update(
            BENTOML_HOME=str(tmp / "bentoml"),
            BENTOML_DO_NOT_TRACK="true",
            OMP_NUM_THREADS="2",
            PYTHONPATH=os.pathsep.join([str(SOURCE_ROOT), os.environ.get("PYTHONPATH", "")]),
            **(env or {}),
        )
        port = free_port()
        self.home = tmp / "bentoml"
        super().__init__(bento_command(port, target, args, working_dir), port, tmp / "serve.log", full_env, working_dir)

    def kill(self) -> None:
        """SIGKILL to the server and every process it started, at once: a crash, not a stop. Returns once all are
        gone (a process in a system call, an fsync, ends it first: until then it may still write)."""
        main = psutil.Process(self.proc.pid)
        family = [main, *main.children(recursive=True)]  # a Bento's workers run in process groups of their own
        for p in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        self.proc.wait(10)
        psutil.wait_procs(family, timeout=10)

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples, plus each histogram's +Inf bucket."""
        from prometheus_client.parser import text_string_to_metric_families

        families = text_string_to_metric_families(self.http.get("/metrics").text)
        return _unlabelled(s for f in families for s in f.samples)

    def stored_metrics(self) -> dict[str, float]:
        """What `metrics()` gives, read from the server's Prometheus multiprocess files (tiffin_prometheus/<pid>
        under its BentoML home, tiffin.plugin.metrics.own_prometheus_dir): every increment up to the last, even
        once the server is killed and /metrics answers no more."""
        from prometheus_client import CollectorRegistry
        from prometheus_client.multiprocess import MultiProcessCollector

        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(self.home / "tiffin_prometheus" / str(self.proc.pid)))
        return _unlabelled(s for f in registry.collect() for s in f.samples)


def _unlabelled(samples) -> dict[str, float]:
    return {s.name: s.value for s in samples if not s.labels or s.labels == {"le": "+Inf"}}
