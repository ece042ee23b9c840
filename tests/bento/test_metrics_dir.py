"""Two Bentos under one BENTOML_HOME keep their own Prometheus multiprocess files (issue #50, defect 9): BentoML
empties its shared directory whenever a server starts, which made the first server's /metrics read the second's
counters. Each "server" here is a process that imports the service module and prepares the directory as
`bentoml serve` does (`bentoml.serving.ensure_prometheus_dir`), then writes a metrics file into it."""

import os
import subprocess
import sys
from pathlib import Path

from tiffin.testing.servers import SOURCE_ROOT

SERVER_START = """
import sys
from pathlib import Path
import tiffin.plugin.service
from bentoml.serving import ensure_prometheus_dir
directory = Path(ensure_prometheus_dir())
(directory / "counter_1.db").write_bytes(b"this server's counters")
print(directory, flush=True)
sys.stdin.readline()  # alive until told to exit
"""


def start(home: Path) -> tuple[subprocess.Popen, Path]:
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env |= {"BENTOML_HOME": str(home), "BENTOML_DO_NOT_TRACK": "true", "PYTHONPATH": str(SOURCE_ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER_START], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    return proc, Path(proc.stdout.readline().strip())


def stop(proc: subprocess.Popen) -> None:
    proc.communicate("\n", timeout=30)


def test_a_second_server_leaves_the_first_servers_metrics(tmp_path):
    first, first_dir = start(tmp_path)
    second, second_dir = start(tmp_path)
    try:
        assert first_dir != second_dir
        assert (first_dir / "counter_1.db").read_bytes() == b"this server's counters"
        assert (second_dir / "counter_1.db").exists()
    finally:
        stop(second)
        stop(first)
    third, third_dir = start(tmp_path)  # the exited servers' directories are removed as the next one starts
    stop(third)
    assert not first_dir.exists() and not second_dir.exists() and third_dir.exists()
