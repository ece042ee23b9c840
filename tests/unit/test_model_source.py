"""Hub ids resolve through huggingface_hub's cache: offline (HF_HUB_OFFLINE=1) from a pre-filled cache, and a
clear error when the files are not there."""

import shutil

import pytest
from huggingface_hub import constants

from tiffin.engine.models.source import resolve_model_path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def offline_hub(tmp_path, monkeypatch, tiny_model):
    """A Hugging Face cache holding `tiffin-test/tiny-llama` at `main`, as a download would leave it."""
    repo = tmp_path / "models--tiffin-test--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.copytree(tiny_model("llama"), repo / "snapshots" / COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return repo / "snapshots" / COMMIT


def test_hub_id_resolves_offline_from_the_cache(offline_hub):
    assert resolve_model_path("tiffin-test/tiny-llama") == str(offline_hub)
    assert resolve_model_path("tiffin-test/tiny-llama", revision=COMMIT) == str(offline_hub)


def test_uncached_hub_id_offline_says_so(offline_hub):
    with pytest.raises(
        ValueError, match="'tiffin-test/absent' is not in the local Hugging Face cache .* HF_HUB_OFFLINE"
    ):
        resolve_model_path("tiffin-test/absent")
    with pytest.raises(ValueError, match="at revision v2 is not in the local Hugging Face cache"):
        resolve_model_path("tiffin-test/tiny-llama", revision="v2")


def test_local_paths_pass_through_and_nonsense_is_refused(tmp_path):
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ValueError, match="neither a local path nor a Hugging Face hub id"):
        resolve_model_path("/no/such/dir")


def test_llm_loads_a_hub_id_offline(offline_hub, tiny_model):
    from tiffin import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    hub = LLM("tiffin-test/tiny-llama", num_kv_blocks=32).generate("Hello", params, use_tqdm=False)
    local = LLM(tiny_model("llama"), num_kv_blocks=32).generate("Hello", params, use_tqdm=False)
    assert hub[0].outputs[0].token_ids == local[0].outputs[0].token_ids
