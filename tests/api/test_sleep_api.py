"""Sleep, wake and weight reload over HTTP, in-process through the Guard (tiffin.plugin.sleep): admin key enforced
(and the routes refused on a server without keys), a completion while asleep is a 503 naming the state, outputs
identical after the wake, update_weights serving what a fresh engine on the new checkpoint serves and a mismatched
checkpoint a 400 naming the difference while the old weights serve on."""

import pytest

pytest.importorskip("bentoml")

from fastapi.testclient import TestClient  # noqa: E402
from starlette.applications import Starlette  # noqa: E402
from starlette.routing import Mount  # noqa: E402

from tiffin import LLM, SamplingParams  # noqa: E402
from tiffin.plugin.guard import Guard  # noqa: E402
from tiffin.plugin.openai.app import create_root_app  # noqa: E402
from tiffin.plugin.sleep import add_sleep_routes  # noqa: E402
from tiffin.tiny import make_tiny_model  # noqa: E402

BODY = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
ADMIN, USER = {"Authorization": "Bearer admin-key"}, {"Authorization": "Bearer user-key"}


def app_over(api, **keys) -> Guard:
    root = create_root_app(api.app)
    add_sleep_routes(root, api.app)
    return Guard(Starlette(routes=[Mount("/v1", api.app), Mount("/", root)]), **keys)


def test_sleep_wake_and_update_weights_over_http(openai_app, tiny_model, tmp_path):
    other = make_tiny_model(tmp_path / "other", seed=7)
    wide = make_tiny_model(tmp_path / "wide", intermediate_size=256)
    fresh = LLM(str(other), num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected_other = fresh.generate([BODY["prompt"]], params, use_tqdm=False)[0].outputs[0].text
    fresh.shutdown()
    keys = {"api_key": "user-key", "admin_api_key": "admin-key"}
    with openai_app(num_kv_blocks=64) as api, TestClient(app_over(api, **keys)) as c:
        before = c.post("/v1/completions", json=BODY, headers=USER).json()["choices"][0]["text"]
        for headers in ({}, USER):
            assert c.post("/sleep", headers=headers).status_code == 401
            assert c.post("/wake_up", headers=headers).status_code == 401
            assert c.post("/update_weights", json={"model_path": str(other)}, headers=headers).status_code == 401
        assert c.post("/sleep?level=3", headers=ADMIN).status_code == 400
        for level in (1, 2):
            assert c.post(f"/sleep?level={level}", headers=ADMIN).json() == {"is_sleeping": True, "level": level}
            assert c.get("/is_sleeping", headers=USER).json() == {"is_sleeping": True}
            refused = c.post("/v1/completions", json=BODY, headers=USER)
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "engine_asleep"
            assert f"asleep (sleep level {level})" in refused.json()["error"]["message"]
            woke = c.post("/wake_up", headers=ADMIN).json()
            assert woke["is_sleeping"] is False and woke["wake_seconds"] >= 0
            assert c.get("/is_sleeping", headers=USER).json() == {"is_sleeping": False}
            assert c.post("/v1/completions", json=BODY, headers=USER).json()["choices"][0]["text"] == before
        mismatch = c.post("/update_weights", json={"model_path": str(wide)}, headers=ADMIN)
        assert mismatch.status_code == 400
        assert "intermediate_size: 256, served 128" in mismatch.json()["error"]["message"]
        assert c.post("/v1/completions", json=BODY, headers=USER).json()["choices"][0]["text"] == before
        unknown = c.post("/update_weights", json={"model_path": str(other), "model": "nope"}, headers=ADMIN)
        assert unknown.status_code == 404
        done = c.post("/update_weights", json={"model_path": str(other)}, headers=ADMIN)
        assert done.status_code == 200 and done.json()["success"]
        after = c.post("/v1/completions", json=BODY, headers=USER).json()["choices"][0]["text"]
        assert after == expected_other != before


def test_refused_without_keys(openai_app):
    with openai_app(num_kv_blocks=16) as api, TestClient(app_over(api)) as c:
        for path in ("/sleep", "/wake_up", "/update_weights"):
            refused = c.post(path, json={"model_path": "/tmp"})
            assert refused.status_code == 403 and "admin_api_key" in refused.json()["error"]["message"]
        assert c.get("/is_sleeping").json() == {"is_sleeping": False}
        assert not api.engine.is_sleeping()
