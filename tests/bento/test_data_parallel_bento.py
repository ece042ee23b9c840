"""The Bento over two data-parallel replicas of the tiny llama (a real `bentoml serve`): /readyz ready, /health
with each replica's state, a LoRA adapter loaded through vLLM's admin route on both replicas and listed by
/v1/models, and /metrics with the per-replica gauges beside the sums. The replicas' failures and the refusals
are tested in-process (tests/api/test_data_parallel_api.py)."""

import pytest

pytest.importorskip("bentoml")

from lora_adapters import make_adapter  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

MODEL = "tiffin-tiny-llama"  # byte-identical to tiny_model("llama"), which the adapter is built for


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory, bento_server):
    root = tmp_path_factory.mktemp("dp-lora")
    make_adapter(tiny_model("llama"), root / "qv", seed=0, r=4, target_modules=["q_proj", "v_proj"])
    return bento_server(
        args={"model": MODEL, "data_parallel_size": 2, "num_kv_blocks": 64},
        env={"TIFFIN_LORA_ROOTS": str(root), "TIFFIN_MAX_LORA_RANK": "8", "TIFFIN_MAX_NUM_SEQS": "4"},
    )


def replica_samples(server) -> dict[tuple[str, str], float]:
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families(server.http.get("/metrics").text)
    return {(s.name, s.labels["replica"]): s.value for f in families for s in f.samples if "replica" in s.labels}


def test_health_lora_and_metrics_over_two_replicas(server):
    health = server.http.get("/health")
    assert health.status_code == 200, health.text
    (model,) = health.json()["models"]
    assert model["healthy"] and [(r["replica"], r["alive"]) for r in model["replicas"]] == [(0, True), (1, True)]

    reply = server.http.post("/v1/load_lora_adapter", json={"lora_name": "qv", "lora_path": "qv"})
    assert reply.status_code == 200, reply.text
    assert [card["id"] for card in server.http.get("/v1/models").json()["data"]] == [MODEL, "qv"]
    texts = {}
    for model_name in ("qv", MODEL):
        body = {"model": model_name, "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}
        reply = server.http.post("/v1/completions", json=body | {"ignore_eos": True})
        assert reply.status_code == 200, reply.text
        texts[model_name] = reply.json()["choices"][0]["text"]
    assert texts["qv"] != texts[MODEL]  # the adapter served

    samples = replica_samples(server)
    assert samples[("tiffin_replica_up", "0")] == samples[("tiffin_replica_up", "1")] == 1
    blocks = sum(samples[("tiffin_replica_kv_cache_blocks_used", r)] for r in "01")
    assert blocks == server.metrics()["tiffin_kv_cache_blocks_used"]
