"""A `bentoml serve` subprocess on a free loopback port, for the plugin tests; `stop()` ends every process
it started."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]


class BentoServer:
    def __init__(
        self, tmp: Path, target: str, args: dict | None = None, env: dict | None = None, working_dir: Path = REPO
    ):
        """Serve `target` ("module:Service") with a scratch BENTOML_HOME under `tmp`; no TIFFIN_* variables
        leak in from the caller's environment besides `env`."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / "serve.log"
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("TIFFIN_")}
        full_env.update(
            BENTOML_HOME=str(tmp / "bentoml"),
            BENTOML_DO_NOT_TRACK="true",
            OMP_NUM_THREADS="2",
            PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            **(env or {}),
        )
        cmd = [
            str(Path(sys.executable).parent / "bentoml"),
            "serve",
            target,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--working-dir",
            str(working_dir),
        ]
        for key, value in (args or {}).items():
            cmd += ["--arg", f"{key}={value}"]
        self.proc = subprocess.Popen(
            cmd,
            cwd=working_dir,
            env=full_env,
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.http = httpx.Client(base_url=self.url, timeout=30)

    def status(self, path: str) -> int:
        try:
            return self.http.get(path, timeout=2).status_code
        except httpx.TransportError:
            return 0

    def wait(self, path: str, code: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.status(path) != code:
            failed = "Application startup failed" in self.log.read_text(errors="replace")
            if failed or self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{path} never answered {code}; server log:\n{self.log.read_text()[-4000:]}")
            time.sleep(0.2)

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples, plus each histogram's +Inf bucket."""
        from prometheus_client.parser import text_string_to_metric_families

        families = text_string_to_metric_families(self.http.get("/metrics").text)
        return {s.name: s.value for f in families for s in f.samples if not s.labels or s.labels == {"le": "+Inf"}}

    def stop(self) -> None:
        self.http.close()
        try:
            main = psutil.Process(self.proc.pid)
            family = [main, *main.children(recursive=True)]
        except psutil.NoSuchProcess:
            family = []
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            pass
        # Workers run in process groups of their own. psutil refuses a pid that was reused meanwhile.
        for p in family:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait(5)
