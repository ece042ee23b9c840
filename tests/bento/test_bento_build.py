"""`bentoml build` from the repo's bentofile.yaml, offline, into a scratch BENTOML_HOME, with the model given
as a BentoML model-store tag (`--arg model=...`), which the Bento then declares."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

pytest.importorskip("bentoml")
yaml = pytest.importorskip("yaml")

REPO = Path(__file__).resolve().parents[2]
SAVE_MODEL = """
import bentoml
with bentoml.models.create("my-llm") as model:
    open(model.path + "/config.json", "w").write("{}")
"""


def test_bentoml_build_offline(tmp_path):
    home = tmp_path / "bentoml"
    dead = "http://127.0.0.1:9"  # any attempt to reach a package index or the hub fails at once
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIFFIN_")}
    env.update(
        BENTOML_HOME=str(home),
        BENTOML_DO_NOT_TRACK="true",
        HF_HUB_OFFLINE="1",
        PIP_NO_INDEX="1",
        UV_OFFLINE="1",
        HTTP_PROXY=dead,
        HTTPS_PROXY=dead,
        http_proxy=dead,
        https_proxy=dead,
        NO_PROXY="",
        no_proxy="",
    )
    subprocess.run([sys.executable, "-c", SAVE_MODEL], env=env, check=True, timeout=120)
    cmd = [str(Path(sys.executable).parent / "bentoml"), "build", str(REPO), "--arg", "model=my-llm:latest"]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    bento = next((home / "bentos" / "tiffin").glob("*/bento.yaml")).parent
    dockerfile = (bento / "env" / "docker" / "Dockerfile").read_text()
    assert "FROM python:3.11" in dockerfile and "build-essential" in dockerfile
    requirements = (bento / "env" / "python" / "requirements.txt").read_text().split()
    assert {"torch>=2.6", "transformers>=5.20", "pillow", "fastapi"} <= set(requirements)
    assert (bento / "src" / "tiffin" / "plugin" / "service.py").is_file()
    csrc = bento / "src" / "tiffin" / "kernels" / "csrc"  # compiled at run time, headers included
    assert (csrc / "cpu_ops.cpp").is_file() and {h.name for h in csrc.glob("*.h")} >= {"cpu_blocks.h", "cpu_math.h"}
    assert not (bento / "src" / "tests").exists() and not list((bento / "src").rglob("__pycache__"))
    info = yaml.safe_load((bento / "bento.yaml").read_text())
    assert info["labels"] == {"openai_endpoint": "/v1"} and info["args"] == {"model": "my-llm:latest"}
    # the weights travel with the Bento: `bentoml containerize` and `bentoml push` copy the service's models
    assert [m["tag"].split(":")[0] for m in info["services"][0]["models"]] == ["my-llm"]
