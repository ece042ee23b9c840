"""Where a model's files are: a local directory or .gguf file as given, or a Hugging Face hub id (`org/name`)
resolved by `huggingface_hub` to its snapshot in the local Hugging Face cache, downloaded first unless
HF_HUB_OFFLINE is set. The token comes from HF_TOKEN (or `huggingface-cli login`), as huggingface_hub reads it."""

import functools
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

from tiffin.cache import default_cache_dir

logger = logging.getLogger(__name__)

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
METADATA_BYTES = 16 << 20  # how much of a GGUF file its tokenizer's cache key reads
# llama.cpp's pre-tokenizers (`tokenizer.ggml.pre`) that split every digit off before GPT-2's regex, as these models'
# own tokenizers do (Digits then ByteLevel); transformers' conversion knows none of them and keeps GPT-2's regex
# alone, which tokenizes whitespace before a digit otherwise ("\n   2": "\n  ", " ", "2" for "\n   ", "2").
DIGIT_SPLIT_PRE = {"smollm", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"}
# what a cached conversion was made by, beside transformers' version: bumped when tiffin's own changes
CONVERSION = "2"


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
    merges and chat template. The conversion takes seconds for a vocabulary of SmolLM2's 49k tokens, loading
    the saved copy a tenth of that, so the copy is kept under the cache dir, per file and transformers version."""
    # here, not at the top: the Bento's model store imports this module, and `bentoml build` must not load torch
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from tiffin.engine.models.gguf_checkpoint import find_gguf

    gguf = find_gguf(path)
    if gguf is None:
        return AutoTokenizer.from_pretrained(path)
    cached = default_cache_dir() / "tokenizers" / _gguf_tokenizer_key(gguf)
    if cached.is_dir():  # complete if there at all: it is renamed into place once written
        try:
            return AutoTokenizer.from_pretrained(cached)
        except Exception as e:  # whatever a damaged copy raises: it is converted again and replaced
            logger.warning("the cached tokenizer %s failed to load, converting %s again: %r", cached, gguf, e)
            shutil.rmtree(cached, ignore_errors=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except ValueError:  # an architecture transformers reads no config of (granite, smollm3): the tokenizer alone
        tokenizer = PreTrainedTokenizerFast.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _split_digits(tokenizer, gguf)
    _save_atomically(tokenizer, cached)
    return tokenizer


def _split_digits(tokenizer, gguf: Path) -> None:
    """The file's pre-tokenizer where it is one of DIGIT_SPLIT_PRE: each digit its own word, then GPT-2's."""
    from tokenizers import pre_tokenizers

    from tiffin.engine.models.gguf_checkpoint import open_gguf

    if open_gguf(gguf).field("tokenizer.ggml.pre") in DIGIT_SPLIT_PRE:
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )


def _gguf_tokenizer_key(gguf: Path) -> str:
    """What a GGUF's converted tokenizer is cached under: the file's size and first bytes, where a GGUF keeps its
    metadata, the vocabulary, merges and chat template among it (a few MB for the largest vocabularies), without
    reading all its gigabytes; and the transformers version and CONVERSION, since another may convert differently.
    Copies of a file share the entry; a test's fresh temporary copy of the same model finds it too."""
    import transformers

    with open(gguf, "rb") as f:
        head = f.read(METADATA_BYTES)
    size = gguf.stat().st_size
    return hashlib.sha256(f"{size}\0{transformers.__version__}\0{CONVERSION}\0".encode() + head).hexdigest()[:32]


def _save_atomically(tokenizer, directory: Path) -> None:
    """`tokenizer` saved to `directory`, written aside and renamed into place: a reader sees all of it or none,
    and of racing writers one rename wins. Not written (a read-only cache, a full disk): a warning, once."""
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory.parent) as tmp:
            tokenizer.save_pretrained(Path(tmp) / "tokenizer")
            os.replace(Path(tmp) / "tokenizer", directory)
    except OSError as e:
        if not directory.is_dir():  # else another process renamed its copy into place first
            _warn_uncached(directory.parent, e.strerror or str(e))


@functools.cache  # once per cache dir and cause, not once per engine build
def _warn_uncached(cache_dir: Path, cause: str) -> None:
    logger.warning(
        "tokenizers converted from GGUF are not cached in %s (%s): each load converts again", cache_dir, cause
    )


def eos_token_ids(model: str, tokenizer) -> set[int]:
    """The ids that end a generation: the GGUF file's, or generation_config.json's, and the tokenizer's."""
    from tiffin.engine.models.gguf_checkpoint import find_gguf, open_gguf

    ids = set()
    gguf, gen_config = find_gguf(model), Path(model) / "generation_config.json"
    if gguf is not None:
        ids.update(open_gguf(gguf).eos_token_ids())
    elif gen_config.exists():
        eos = json.loads(gen_config.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
