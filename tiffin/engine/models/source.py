"""Where a model's files are: a local directory or .gguf file as given, or a Hugging Face hub id (`org/name`)
resolved by `huggingface_hub` to its snapshot in the local Hugging Face cache, downloaded first unless
HF_HUB_OFFLINE is set. The token comes from HF_TOKEN (or `huggingface-cli login`), as huggingface_hub reads it."""

import re
from pathlib import Path

# what tiffin reads from a hub repo: weights, configs, tokenizer; never other formats' duplicates of the weights
HUB_FILES = [
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "quantize_config.json",
    "quant_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
]
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def resolve_model_path(model: str, revision: str | None = None) -> str:
    """The local path of `model`: itself if it exists, else the hub snapshot of `org/name` at `revision`."""
    if Path(model).exists():
        return model
    if not HUB_ID.fullmatch(model):
        raise ValueError(f"model {model!r} is neither a local path nor a Hugging Face hub id (org/name)")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(model, revision=revision, allow_patterns=HUB_FILES)
    except LocalEntryNotFoundError:
        if not constants.HF_HUB_OFFLINE:
            raise
        at = f" at revision {revision}" if revision else ""
        raise ValueError(
            f"model {model!r}{at} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and "
            f"HF_HUB_OFFLINE is set: download it once with network access, or unset HF_HUB_OFFLINE"
        ) from None


def load_tokenizer(path: str):
    """The tokenizer of a Hugging Face directory, or transformers' conversion of a GGUF file's vocabulary,
    merges and chat template."""
    # here, not at the top: the Bento's model store imports this module, and `bentoml build` must not load torch
    from transformers import AutoTokenizer

    from tiffin.engine.models.gguf_checkpoint import find_gguf

    gguf = find_gguf(path)
    if gguf is None:
        return AutoTokenizer.from_pretrained(path)
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
