"""llama.cpp as a peer, for the tests and the benchmarks: its converter and tools run in an environment free of
tiffin's OpenMP defaults, and a failure names the command with the end of what it printed."""

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import tiffin

# The tokenizers made up by the tests are no BPE the converter knows by hash: it is told 'gpt-2' (decode uses no text);
# nor a sentencepiece model, which Gemma 2's and Phi-3's converters read: they write them as the BPE they are.
CONVERT = """import importlib, sys
sys.path[:0] = [{root!r}, {root!r} + "/gguf-py"]
import convert_hf_to_gguf
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
for module, name in (("conversion.gemma", "Gemma2Model"), ("conversion.phi", "Phi3MiniModel")):
    getattr(importlib.import_module(module), name).set_vocab = TextModel._set_vocab_gpt2
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[1:]]
convert_hf_to_gguf.main()
"""


def peer_env() -> dict[str, str]:
    """A peer's environment: none of the OpenMP defaults that importing tiffin set in this process."""
    return {k: v for k, v in os.environ.items() if k not in tiffin.ENV_SET_BY_TIFFIN}


def run_peer(command: Sequence[str]) -> None:
    """Runs a llama.cpp command to its end; RuntimeError with the last of its stderr if it fails."""
    done = subprocess.run([str(part) for part in command], capture_output=True, text=True, env=peer_env())
    if done.returncode:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"{Path(str(command[0])).name} ... exited {done.returncode}:\n{tail}")


def convert_hf_to_gguf(source: Path, hf_dir: Path, outtype: str, outfile: Path) -> None:
    """llama.cpp's convert_hf_to_gguf.py (from the source tree `source`) writes `hf_dir` as `outfile`."""
    script = CONVERT.format(root=str(source))
    run_peer([sys.executable, "-c", script, hf_dir, "--outtype", outtype, "--outfile", outfile])
