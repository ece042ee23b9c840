"""`tiffin generate`: a bad argument or a model that cannot be served is one line on stderr, no traceback (exit 2
for arguments, 1 for the model), and nothing is written into the working directory."""

import os
import subprocess
import sys

import pytest

from tiffin import cli


def run_generate(cwd, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "XDG_CACHE_HOME": str(cwd / "cache")}
    command = [sys.executable, "-m", "tiffin.cli", "generate", "hello", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.subprocess
@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-tokens", "0"], "argument --max-tokens: max_tokens must be an integer >= 1"),
        (["--temperature", "nan"], "argument --temperature: temperature must be finite"),
        (["--dtype", "bogus"], "argument --dtype: invalid choice: 'bogus'"),
        (["--seed", str(2**70)], "argument --seed: seed must be a 64-bit integer"),
        (["--model", "missing"], "argument --model: model 'missing' is neither a local path"),
        (["--model", "nobody/missing"], "argument --model: model 'nobody/missing' is not in the local Hugging Face"),
    ],
    ids=["max_tokens", "temperature", "dtype", "seed", "missing_path", "missing_hub_id"],
)
def test_a_bad_argument_is_one_line_and_exit_2(tmp_path, args, message):
    out = run_generate(tmp_path, *args)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(f"tiffin generate: error: {message}") and out.stderr.count("\n") == 1, out.stderr
    assert out.stdout == "" and os.listdir(tmp_path) == []


@pytest.mark.subprocess
def test_a_model_that_cannot_be_read_is_one_line_and_exit_1(tmp_path):
    (tmp_path / "broken.gguf").write_bytes(b"GGUF")
    out = run_generate(tmp_path, "--model", "broken.gguf")
    assert out.returncode == 1, out.stderr
    assert out.stderr == "tiffin generate: error: broken.gguf: GGUF header: 4 bytes are too few for one (truncated?)\n"


def test_the_default_tiny_model_is_written_under_the_cache_folder(tmp_path, monkeypatch, capsys):
    work, cache = tmp_path / "work", tmp_path / "cache"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setattr(cli, "default_cache_dir", lambda: cache)
    cli.main(["generate", "hello", "--max-tokens", "2"])
    assert capsys.readouterr().out.startswith("'hello' -> ")
    assert os.listdir(work) == [] and (cache / "tiny-llama" / "config.json").exists()
