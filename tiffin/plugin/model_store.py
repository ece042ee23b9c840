"""Where the served weights come from: a local Hugging Face directory, a BentoML model-store tag, or the
built-in tiny model (written into the model store on first use; nothing is downloaded)."""

from pathlib import Path

import bentoml

TINY_MODEL_TAG = "tiffin-tiny-llama"


def resolve_model(spec: str | None) -> tuple[str, str]:
    """(local path, served name) for a directory, a BentoML model tag, or None (the built-in tiny model)."""
    if spec is None:
        return tiny_model_path(), TINY_MODEL_TAG
    if Path(spec).is_dir():
        return spec, Path(spec).resolve().name
    try:
        return bentoml.models.get(spec).path, spec.split(":")[0]
    except bentoml.exceptions.NotFound:
        raise ValueError(f"model {spec!r} is neither a local directory nor a BentoML model tag") from None


def tiny_model_path() -> str:
    try:
        return bentoml.models.get(TINY_MODEL_TAG).path
    except bentoml.exceptions.NotFound:
        from tiffin.tiny import make_tiny_model

        with bentoml.models.create(TINY_MODEL_TAG, labels={"source": "tiffin.tiny"}) as model:
            make_tiny_model(model.path)
        return bentoml.models.get(TINY_MODEL_TAG).path
