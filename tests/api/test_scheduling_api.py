"""What the scheduler's priorities and fair share need from the OpenAI app: every generation route hands the
engine the request's `priority` and its client, the API key it presented (the same key, the same client). How the
scheduler orders them is tested on the engine (tests/engine/test_engine_scheduling.py), where steps are counted:
an in-process HTTP client reads a stream only once it ended, so it cannot show the interleaving."""

import pytest

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from tiffin.plugin.guard import Guard  # noqa: E402

MESSAGES = [{"role": "user", "content": "Hi"}]
ROUTES = [
    ("/completions", {"prompt": "Hi"}),
    ("/chat/completions", {"messages": MESSAGES}),
    ("/responses", {"input": "Hi"}),
]


@pytest.fixture(scope="module")
def api(openai_app):
    with openai_app(num_kv_blocks=128, scheduling_policy="priority", fair_share=True) as api:
        yield api


@pytest.mark.parametrize("path, body", ROUTES)
def test_priority_and_client_reach_the_engine(api, monkeypatch, path, body):
    added = []
    add_request = api.engine.add_request

    async def spy(request_id, prompt, params, lora=None, client=None):
        added.append((params.priority, client))
        return await add_request(request_id, prompt, params, lora, client=client)

    monkeypatch.setattr(api.engine, "add_request", spy)
    limit = {"max_output_tokens" if path == "/responses" else "max_tokens": 2}
    with TestClient(api.app) as http:
        for key, priority in (("key-a", 3), ("key-b", -1), ("key-a", 0), (None, 0)):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            ask = {"model": "tiny", **body, **limit, "priority": priority}
            assert http.post(path, json=ask, headers=headers).status_code == 200
    priorities, clients = zip(*added)
    assert priorities == (3, -1, 0, 0)
    assert clients[0] == clients[2] != clients[1] and None not in clients[:3] and clients[3] is None


@pytest.mark.parametrize("path, body", ROUTES)
def test_a_user_key_may_only_lower_its_own_priority(api, path, body):
    """Any key could ask for the most urgent priority and take every seat (issue #50, defect 4): below
    `min_user_priority`, a user key's request is a 400 naming `priority`; the admin key may ask any."""
    guard = Guard(api.app, api_key="key-a,key-b", admin_api_key="admin", min_user_priority=0)
    limit = {"max_output_tokens" if path == "/responses" else "max_tokens": 2}
    with TestClient(guard) as http:
        ask = lambda key, priority: http.post(
            path, json={"model": "tiny", **body, **limit, "priority": priority}, headers={"x-api-key": key}
        )
        refused = ask("key-a", -1)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority", refused.text
        assert ask("key-b", 3).status_code == ask("admin", -5).status_code == 200
        assert ask("key-a", 0).status_code == 200
