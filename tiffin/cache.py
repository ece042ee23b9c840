"""Where tiffin keeps what it fetches or builds once: ~/.cache/tiffin, or under XDG_CACHE_HOME."""

import os
from pathlib import Path


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tiffin"
