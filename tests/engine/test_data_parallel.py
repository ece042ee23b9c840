"""Data parallelism, DP=2 on CPU (one module-wide engine: its replicas take seconds to start): greedy outputs equal
one engine's with the summed pool; a prompt sharing a prefix goes where its blocks are; KV events read from ZMQ with
plain msgpack, as vLLM's format documents them (not tiffin's classes), rebuild each replica's prefix cache exactly
after evictions; streaming and abort through AsyncLLMEngine; a killed replica fails only its own requests, naming
it, and is started again, rejoining empty; no block held after any of it."""

import asyncio
import hashlib
import os
import signal
import struct
import time

import msgpack
import pytest
import torch
import zmq
from lora_adapters import make_adapter
from zmq.utils.monitor import recv_monitor_message

from tiffin import LLM, SamplingParams
from tiffin.engine.async_llm_engine import AsyncLLMEngine
from tiffin.engine.errors import EngineAsleep, EngineError
from tiffin.engine.lora.request import LoRARequest

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

BLOCK = 4
BLOCKS = 48  # per replica; the single engine gets both replicas' pools
ENGINE = dict(block_size=BLOCK, dtype="float32", max_num_seqs=8, enable_lora=True)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def prompts(n: int, seed: int, lens=(1, 7, 13, 23, 31, 41)) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(4, 2000, (length,), generator=g).tolist()} for length in lens * n][:n]


def tokens(llm: LLM, ps: list, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model("llama"))


@pytest.fixture(scope="module")
def single(model):
    llm = LLM(model, num_kv_blocks=2 * BLOCKS, **ENGINE)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def subscriber(tmp_path_factory):
    """A SUB socket on both replicas' endpoints, connecting before they bind (ZMQ connects once they do); `dp_llm`
    waits for both connections, so that it sees every batch from the first."""
    endpoint = f"ipc://{tmp_path_factory.mktemp('kv')}/events"
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)  # read only at the end: keep every batch (past the high-water mark ZMQ drops)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    for replica_endpoint in (endpoint, f"{endpoint}_1"):  # replica r's: the endpoint with _r appended (r > 0)
        sub.connect(replica_endpoint)
    yield endpoint, sub
    sub.close(0)
    context.term()


@pytest.fixture(scope="module")
def dp_llm(model, subscriber):
    endpoint, sub = subscriber
    monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED)
    llm = LLM(
        model, num_kv_blocks=BLOCKS, data_parallel_size=2, kv_events_endpoint=endpoint, kv_events_topic="kv", **ENGINE
    )
    for _ in range(2):  # both replicas bound and the subscriber connected to each, before the first request
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_CONNECTED
    sub.disable_monitor()
    time.sleep(0.5)  # the subscription, sent on connecting, reaches each PUB socket (ZMQ's "slow joiner")
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def dp(dp_llm):
    return dp_llm.llm_engine


@pytest.fixture(autouse=True)
def no_blocks_held_after(request):
    yield
    if "dp" in request.fixturenames:
        engine = request.getfixturevalue("dp")
        assert not engine.requests and engine.stats().kv_blocks_used == 0


def test_outputs_equal_one_engines(single, dp_llm, dp):
    ps, llm = prompts(12, seed=0), dp_llm
    assert tokens(llm, ps) == tokens(single, ps)
    assert all(s.prompt_tokens > 0 for s in dp.replica_stats), "a replica served nothing"
    n2 = SamplingParams(temperature=0, max_tokens=5, n=2, ignore_eos=True)
    assert [[c.token_ids for c in o.outputs] for o in llm.generate(ps[:3], n2, use_tqdm=False)] == [
        [c.token_ids for c in o.outputs] for o in single.generate(ps[:3], n2, use_tqdm=False)
    ]


def test_a_shared_prefix_goes_where_its_blocks_are(dp_llm, dp):
    llm = dp_llm
    system = prompts(1, seed=1, lens=(40,))[0]["prompt_token_ids"]
    tokens(llm, [{"prompt_token_ids": system + [5, 6]}])
    before = [s.prefix_cache_hits for s in dp.replica_stats]
    for i in range(4):  # each the only request: loads are equal, so only the cache decides
        tokens(llm, [{"prompt_token_ids": system + [7 + i] * 9}])
    hits = [s.prefix_cache_hits - b for s, b in zip(dp.replica_stats, before)]
    assert sorted(hits) == [0, 4 * 40], hits  # every request found its 10 blocks of the system prompt
    assert llm.reset_prefix_cache()  # every replica's cache emptied: the prompt again finds nothing
    before = [s.prefix_cache_hits for s in dp.replica_stats]
    tokens(llm, [{"prompt_token_ids": system + [5, 6]}])
    assert [s.prefix_cache_hits for s in dp.replica_stats] == before


def test_adapters_match_and_stay_with_their_blocks(single, dp_llm, dp, model, tmp_path):
    """Requests with adapters give one engine's outputs; an adapter's prompt that shares a prefix follows its blocks,
    hashed with the adapter's identity (which the router learns from the replica that loaded it)."""
    loras = [LoRARequest(f"a{i}", i, str(make_adapter(model, tmp_path / f"a{i}", seed=i, r=4))) for i in (1, 2)]
    ps = prompts(6, seed=5, lens=(21, 30))
    per_prompt = [loras[0], loras[1], None] * 2
    got = [o.outputs[0].token_ids for o in dp_llm.generate(ps, GREEDY, use_tqdm=False, lora_request=per_prompt)]
    assert got == [o.outputs[0].token_ids for o in single.generate(ps, GREEDY, use_tqdm=False, lora_request=per_prompt)]
    assert got[0] != tokens(single, ps[:1])[0], "the adapter changes nothing"
    assert set(dp._lora_keys) == {1, 2}
    system = prompts(1, seed=6, lens=(40,))[0]["prompt_token_ids"]
    dp_llm.generate({"prompt_token_ids": system + [3]}, GREEDY, use_tqdm=False, lora_request=loras[0])
    before = [s.prefix_cache_hits for s in dp.replica_stats]
    for i in range(3):
        dp_llm.generate({"prompt_token_ids": system + [4 + i] * 5}, GREEDY, use_tqdm=False, lora_request=loras[0])
    assert sorted(s.prefix_cache_hits - b for s, b in zip(dp.replica_stats, before)) == [0, 3 * 40]


def batches(sub) -> list[tuple[bytes, int, list]]:
    """Every message queued on the SUB socket, decoded with msgpack alone: (topic, sequence number, batch)."""
    out = []
    while sub.poll(1000):
        topic, seq, payload = sub.recv_multipart()
        out.append((topic, int.from_bytes(seq, "big"), msgpack.unpackb(payload)))
    return out


def test_kv_events_rebuild_each_replicas_cache(dp_llm, dp, subscriber):
    """A subscriber written from vLLM's documented format: a batch is [ts, events, data_parallel_rank]; an event
    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium], ["BlockRemoved",
    block_hashes, medium] or ["AllBlocksCleared"]. Hashes are sha256(parent + tokens as int64 LE) (tiffin's chain)."""
    llm = dp_llm
    for seed in range(3):  # many more distinct blocks than the pools hold: evictions
        tokens(llm, prompts(10, seed=10 + seed, lens=(41, 37, 29)))
    cached = [dp._call(rank, "block_manager.cached.copy") for rank in range(2)]  # after every event was sent
    held, seqs, removed = [set(), set()], [[], []], [0, 0]
    for topic, seq, (ts, events, rank) in batches(subscriber[1]):
        assert topic == b"kv" and ts > 0
        seqs[rank].append(seq)
        for tag, *fields in events:
            if tag == "BlockStored":
                hashes, parent, token_ids, block_size, lora_id, medium = fields
                assert block_size == BLOCK and lora_id in (None, 1, 2) and medium is None
                for i, h in enumerate(hashes):
                    block = token_ids[i * BLOCK : (i + 1) * BLOCK]
                    if lora_id is None:  # an adapter's identity is hashed in after the tokens
                        assert h == hashlib.sha256((parent or b"") + struct.pack(f"<{BLOCK}q", *block)).digest()
                    parent = h
                held[rank].update(hashes)
            elif tag == "BlockRemoved":
                removed[rank] += len(fields[0])
                held[rank].difference_update(fields[0])
            else:
                assert tag == "AllBlocksCleared"
                held[rank].clear()
    assert seqs == [list(range(len(seqs[0]))), list(range(len(seqs[1])))], "a batch was lost or reordered"
    assert all(removed), f"no evictions: {removed}"
    assert held == [set(c) for c in cached]
    assert dp.router.blocks == held  # the router follows the same events


def test_sleep_wake_and_reload_reach_every_replica(single, dp_llm, dp, model):
    ps = prompts(4, seed=7)
    dp_llm.sleep(1)
    assert dp.router.blocks == [set(), set()]  # the cleared caches' events came back with the call
    assert dp_llm.is_sleeping() and all(dp._call(rank, "is_sleeping") for rank in range(2))
    with pytest.raises(EngineAsleep):
        dp_llm.generate(ps, GREEDY, use_tqdm=False)
    dp_llm.wake_up()
    dp_llm.update_weights(model)
    assert tokens(dp_llm, ps) == tokens(single, ps)


@pytest.fixture(scope="module")
def served(dp):
    engine = AsyncLLMEngine(dp)
    yield engine
    engine.shutdown()


def test_streaming_and_abort(served, dp, single):
    ps = prompts(2, seed=3, lens=(9, 17))
    long = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    expected = tokens(single, ps[:1], long)[0]

    async def go():
        seen = []
        async for out in served.generate(ps[0], long):
            seen.append(list(out.outputs[0].token_ids))
        assert len(seen) > 1 and all(a == b[: len(a)] for a, b in zip(seen, seen[1:]))
        assert seen[-1] == expected
        stream = await served.add_request("abort-me", ps[1], long)
        async for out in stream:
            if out.outputs[0].token_ids:
                served.abort("abort-me")
            if out.finished:
                break
        assert out.outputs[0].finish_reason == "abort" and len(out.outputs[0].token_ids) < 120

    asyncio.run(go())


def test_the_openai_app_serves_over_the_replicas(served, dp, single):
    from fastapi.testclient import TestClient

    from tiffin.plugin.openai.app import create_app
    from tiffin.plugin.openai.serving import OpenAIServing

    client = TestClient(create_app(OpenAIServing(served, "tiny")))
    messages = [{"role": "user", "content": "hello there"}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0}
    reply = client.post("/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    expected = single.chat(messages, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs[0].text
    assert reply.json()["choices"][0]["message"]["content"] == expected
    with client.stream("POST", "/chat/completions", json=body | {"stream": True}) as stream:
        lines = [line for line in stream.iter_lines() if line.startswith("data: {")]
    assert len(lines) > 1 and stream.status_code == 200
    assert client.get("/models").json()["data"][0]["id"] == "tiny"


def test_a_killed_replica_fails_only_its_requests_and_rejoins(served, dp, single, model, tmp_path):
    """kill -9 of a replica mid-run: exactly its requests in flight fail, each naming it and the signal; the router
    sends it nothing more at once; the others complete with one engine's tokens. It is started again and taken in
    empty (no block in the router's map, no adapter), counted in the metrics, and serves; the adapter that was added
    on it is read where its next request goes."""
    from tiffin.plugin.metrics import engine_metrics

    long = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    ps = prompts(4, seed=4, lens=(4, 9, 6, 11))  # two on each replica, running together in its 192-token pool
    expected, fresh = tokens(single, ps, long), prompts(4, seed=8, lens=(5, 10))
    lora = LoRARequest("kept", 3, str(make_adapter(model, tmp_path / "kept", seed=3, r=4)))
    call = lambda method, *args: served._call_engine(method, *args)

    async def run(prompt, params, request_id=None, lora_request=None):
        try:
            return [
                out async for out in served.generate(prompt, params, request_id=request_id, lora_request=lora_request)
            ][-1]
        except EngineError as e:
            return e

    async def go():
        await call("add_lora", lora)  # on one replica: the victim
        tasks = [asyncio.create_task(run(p, long, f"kill-{i}")) for i, p in enumerate(ps)]
        generating = lambda routed: all(  # past its prompt: a routed request's load counts its outputs
            routed[f"kill-{i}"].tokens > len(p["prompt_token_ids"]) if f"kill-{i}" in routed else False
            for i, p in enumerate(ps)
        )
        while not generating(routed := dict(dp.requests)):
            assert not any(task.done() for task in tasks), "a request ended before every one was generating"
            await asyncio.sleep(0.001)
        victim = next(r for r, held in enumerate(dp.replica_loras) if 3 in held)
        os.kill(dp.procs[victim].pid, signal.SIGKILL)
        killed = time.monotonic()
        while dp.dead[victim] is None:  # the engine thread saw it die: from now on nothing goes there
            await asyncio.sleep(0.01)
        assert victim not in dp.router.lora_replicas[3]
        assert served.ready and "restarting it" in dp.replica_health()[victim]["error"]  # the other serves
        during = asyncio.create_task(run(fresh[0], GREEDY, "during"))
        while "during" not in dp.requests and not during.done():
            await asyncio.sleep(0.001)
        sent_to = dp.requests["during"].replica if "during" in dp.requests else None
        results = await asyncio.gather(*tasks, during)
        while not dp.replica_health()[victim]["alive"]:
            assert time.monotonic() - killed < 300, "the replica never rejoined"  # a hang guard, not a timing bar
            await asyncio.sleep(0.05)
        rejoined = time.monotonic() - killed
        held = await call("_call", victim, "block_manager.cached.copy")  # an engine call takes the replica in first
        loras = await call("_call", victim, "list_loras")
        after = await asyncio.gather(*(run(p, GREEDY) for p in fresh))
        adapter = await run(fresh[1], GREEDY, lora_request=lora)
        cached = await call("_call", victim, "block_manager.cached.copy")  # the reports before it came with it
        return victim, routed, sent_to, results, (held, cached), after, loras, rejoined, adapter

    victim, routed, sent_to, results, (held, cached), after, loras, rejoined, adapter = asyncio.run(go())
    *results, during = results
    failed = {f"kill-{i}" for i, r in enumerate(results) if isinstance(r, EngineError)}
    assert failed == {rid for rid, r in routed.items() if r.replica == victim} and 0 < len(failed) < len(ps)
    assert all(f"replica {victim} died (killed by SIGKILL)" in str(r) for r in results if isinstance(r, EngineError))
    assert all(r.outputs[0].token_ids == expected[i] for i, r in enumerate(results) if f"kill-{i}" not in failed)
    assert sent_to == 1 - victim and during.outputs[0].token_ids == tokens(single, fresh[:1])[0]
    print(f"replica {victim} rejoined {rejoined:.1f} s after it was killed")
    assert held == {}  # its prefix cache starts empty
    assert [o.outputs[0].token_ids for o in after] == tokens(single, fresh)
    assert dp.replica_stats[victim].prompt_tokens > 0, "the restarted replica served nothing"
    assert dp.router.blocks[victim] == set(cached) != set()  # its map follows the new replica's events alone
    assert loras == set() and dp.replica_health()[victim]["restarts"] == 1
    with_lora = single.generate(fresh[1], GREEDY, lora_request=lora, use_tqdm=False)[0].outputs[0].token_ids
    assert adapter.outputs[0].token_ids == with_lora != after[1].outputs[0].token_ids
    metrics = engine_metrics()
    metrics.on_replicas(dp.replica_health())
    from prometheus_client import REGISTRY

    assert REGISTRY.get_sample_value("tiffin_replica_restarts_total", {"replica": str(victim)}) == 1
    assert served.healthy and served.ready and dp.failure() is None and dp.dead == [None, None]
    assert asyncio.run(call("remove_lora", 3))


def test_offline_generate_waits_for_room_in_the_replicas_queues(model, single):
    """`LLM` holds back what the front refuses with QueueFull (max_waiting_requests=1 per replica), as it does with
    one engine, and an adapter no replica can read is refused naming its prompt."""
    ps = prompts(6, seed=7)
    llm = LLM(model, num_kv_blocks=BLOCKS, data_parallel_size=2, max_waiting_requests=1, **ENGINE)
    try:
        assert tokens(llm, ps) == tokens(single, ps)
        with pytest.raises(ValueError, match="prompt 0: .*not a directory"):
            llm.generate(ps[:2], GREEDY, lora_request=LoRARequest("gone", 5, "/nonexistent-adapter"), use_tqdm=False)
        assert not llm.llm_engine.requests
    finally:
        llm.shutdown()
