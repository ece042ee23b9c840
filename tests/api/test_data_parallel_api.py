"""The OpenAI app over a data-parallel engine (two replicas of the tiny llama): the waiting queues refused at the
front as one engine refuses them (QueueFull, ParamError; a 429 over HTTP), LoRA adapters loaded on one replica and
unloaded from all through vLLM's admin routes and listed by /models (served as one engine serves them), and each
replica's health in /health and in the per-replica metrics, with /health and readiness holding while one replica
lives.

Order matters: the queue test drives the front directly before `served` wraps it; the last test kills the
replicas."""

import asyncio
import os
import shutil
import signal
import time

import pytest
import torch
from lora_adapters import make_adapter
from safetensors.torch import load_file, save_file

from tiffin import LLM, SamplingParams
from tiffin.engine.async_llm_engine import AsyncLLMEngine
from tiffin.engine.config import EngineConfig
from tiffin.engine.data_parallel import DataParallelEngine
from tiffin.engine.errors import ParamError, QueueFull
from tiffin.engine.lora.request import LoRARequest

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

ENGINE = dict(block_size=4, num_kv_blocks=64, dtype="float32", max_num_seqs=4, enable_lora=True, max_lora_rank=8)
PROMPT = "The quick brown fox"
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model("llama"))


@pytest.fixture(scope="module")
def adapters(model, tmp_path_factory):
    """A good adapter in the root and one whose B matrices do not fit the model."""
    root = tmp_path_factory.mktemp("dp-lora")
    good = make_adapter(model, root / "qv", seed=0, r=4, target_modules=["q_proj", "v_proj"])
    bad = shutil.copytree(good, root / "wrong-shape")
    tensors = load_file(bad / "adapter_model.safetensors")
    save_file(
        {k: torch.cat([v, v]) if "lora_B" in k else v for k, v in tensors.items()}, bad / "adapter_model.safetensors"
    )
    return root


@pytest.fixture(scope="module")
def front(model, adapters):
    config = EngineConfig(
        model=model,
        data_parallel_size=2,
        lora_roots=str(adapters),
        max_waiting_requests=2,
        max_waiting_per_client=1,
        data_parallel_max_restarts=0,  # the last test kills the replicas for good (restarts: tests/engine)
        **ENGINE,
    )
    engine = DataParallelEngine(config)
    yield engine
    engine.shutdown()


def test_full_queues_are_refused_at_the_front_as_one_engine_refuses(front):
    def add(rid: str, client: str | None = None, n: int = 1):
        front.add_request(rid, PROMPT, SamplingParams(max_tokens=2, n=n), client=client)

    assert (front.config.max_waiting_requests, front.config.max_waiting_per_client) == (2, 1)  # the front's, kept
    with pytest.raises(ParamError, match="max_waiting_per_client=1") as refused:
        add("two-seqs", client="a", n=2)
    assert refused.value.param == "n"
    # no step between: no replica has taken anything, so every request sent waits as far as the front knows
    add("a0", client="a")
    add("a1", client="a")  # replica 0 holds one of a's: the other replica
    assert {front.requests[r].replica for r in ("a0", "a1")} == {0, 1}
    with pytest.raises(QueueFull, match="max_waiting_per_client=1"):
        add("a2", client="a")
    add("x0")
    add("x1")
    with pytest.raises(QueueFull, match="max_waiting_requests=2 per replica"):
        add("x2")
    assert set(front.requests) == {"a0", "a1", "x0", "x1"}  # nothing of a refused one kept
    while front.has_unfinished_requests():
        front.step()
    for r in range(2):  # the reports bring the queues down again
        assert front.queue.taken[r] == front.queue.sent[r] and not +front.queue.waiting[r]
    add("a3", client="a")
    add("x3")
    while front.has_unfinished_requests():
        front.step()
    assert front.stats().kv_blocks_used == 0


def test_an_adapter_a_replica_cannot_read_is_refused_by_add_request(front, adapters):
    """As one engine refuses it: raised from add_request (the OpenAI layer's 400), no request or load left."""
    for name, lora_id, why in (("wrong-shape", 7, "do not fit the base layer"), ("missing", 8, "missing")):
        with pytest.raises(ValueError, match=why):
            front.add_request(name, PROMPT, GREEDY, LoRARequest(name, lora_id, str(adapters / name)))
    assert not front.requests and sum(front.loads) == 0 and not any(map(sum, front.router.inflight))
    lora = LoRARequest("qv", 9, str(adapters / "qv"))
    front.add_request("cold", PROMPT, GREEDY, lora)  # read on the replica, waited for
    while front.has_unfinished_requests():
        front.step()
    replica = next(r for r, held in enumerate(front.replica_loras) if 9 in held)
    assert front.router.lora_replicas[9] == {replica}
    front.add_request("warm", PROMPT, GREEDY, lora)  # cached there now: sent without waiting
    while front.has_unfinished_requests():
        front.step()
    assert front.remove_lora(9) and 9 not in front.replica_loras[replica]


@pytest.fixture(scope="module")
def served(front):
    engine = AsyncLLMEngine(front)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def client(served, adapters):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from tiffin.plugin.lora import LoRAServing
    from tiffin.plugin.openai.app import create_app, create_root_app
    from tiffin.plugin.openai.serving import OpenAIServing

    v1 = create_app(OpenAIServing(served, "tiny", lora=LoRAServing(served, str(adapters), "tiny")))
    app = FastAPI()
    app.mount("/v1", v1)
    app.mount("/", create_root_app(v1))
    return TestClient(app)


def replica_loras(served) -> list[set[int]]:
    """The adapters each live replica caches, asked between the engine thread's steps."""
    return asyncio.run(served._call_engine("_call_all", "list_loras"))


def complete(client, model: str) -> str:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def test_adapters_load_on_one_replica_and_unload_from_every_one(client, served, model, adapters):
    """vLLM's admin routes: an adapter is read by one replica, which its requests then stay on (LoRA affinity);
    one that cannot be read is a 400 that leaves nothing behind; unloading drops it everywhere."""
    ids = lambda: [card["id"] for card in client.get("/v1/models").json()["data"]]
    single = LLM(model, **ENGINE)
    try:
        lora = LoRARequest("qv", 1, str(adapters / "qv"))
        expected = single.generate(PROMPT, GREEDY, lora_request=lora, use_tqdm=False)[0].outputs[0].text
        base = single.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].text
    finally:
        single.shutdown()
    assert expected != base  # the adapter shows in the text

    reply = client.post("/v1/load_lora_adapter", json={"lora_name": "qv", "lora_path": "qv"})
    assert reply.status_code == 200, reply.text
    holding = replica_loras(served)
    assert ids() == ["tiny", "qv"] and sorted(map(sorted, holding)) == [[], [1]]
    assert [complete(client, "qv") for _ in range(4)] == [expected] * 4
    assert replica_loras(served) == holding  # every one served where the adapter is
    assert complete(client, "tiny") == base

    reply = client.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "wrong-shape"})
    assert reply.status_code == 400 and "not loaded" in reply.json()["error"]["message"]
    assert ids() == ["tiny", "qv"] and replica_loras(served) == holding  # no replica kept it

    reply = client.post("/v1/unload_lora_adapter", json={"lora_name": "qv"})
    assert reply.status_code == 200, reply.text
    assert ids() == ["tiny"] and replica_loras(served) == [set(), set()]
    body = {"model": "qv", "prompt": PROMPT, "max_tokens": 2}
    assert client.post("/v1/completions", json=body).status_code == 404
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "qv"}).status_code == 404


def test_full_queues_are_a_429_as_with_one_engine(client, front):
    limit, front.queue.limit = front.queue.limit, 0  # every replica's queue full
    try:
        reply = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2})
    finally:
        front.queue.limit = limit
    assert reply.status_code == 429 and reply.headers["retry-after"] == "1"
    assert "max_waiting_requests=0 per replica" in reply.json()["error"]["message"]
    complete(client, "tiny")  # room again: a 200


def metric(name: str, replica: int | None = None) -> float:
    from prometheus_client import REGISTRY

    labels = None if replica is None else {"replica": str(replica)}
    return REGISTRY.get_sample_value(name, labels)


def test_health_and_metrics_per_replica_while_one_lives(client, served, front):
    from tiffin.plugin.metrics import engine_metrics

    metrics = engine_metrics()

    def check(alive: list[bool]):
        reply = client.get("/health")
        assert reply.status_code == (200 if any(alive) else 503)
        (detail,) = reply.json()["models"]
        assert [r["alive"] for r in detail["replicas"]] == alive and detail["healthy"] == any(alive)
        assert all((r["error"] is None) == up for r, up in zip(detail["replicas"], alive))
        assert served.ready == any(alive)  # the Bento's /readyz
        metrics.on_stats(front.stats())
        metrics.on_replicas(front.replica_health())
        assert [metric("tiffin_replica_up", r) for r in range(2)] == [float(up) for up in alive]
        total = sum(metric("tiffin_replica_kv_cache_blocks_used", r) for r in range(2))
        assert total == metric("tiffin_kv_cache_blocks_used") == 0

    check([True, True])
    assert [r["kv_blocks_total"] for r in front.replica_health()] == [64, 64]
    os.kill(front.procs[1].pid, signal.SIGKILL)
    front.procs[1].join(10)
    check([True, False])
    error = client.get("/health").json()["models"][0]["replicas"][1]["error"]
    assert "replica 1 died (killed by SIGKILL); not restarted (data_parallel_max_restarts=0)" in error
    for _ in range(3):  # the survivor serves every request
        complete(client, "tiny")
    os.kill(front.procs[0].pid, signal.SIGKILL)
    front.procs[0].join(10)
    deadline = time.monotonic() + 10
    while served.healthy and time.monotonic() < deadline:
        time.sleep(0.05)
    check([False, False])
