"""Data parallelism with `data_parallel_backend="ray"`: DP=2 over a Ray cluster of two nodes on this host, each a
raylet at its own loopback address (127.0.0.1, where this process joins, and 127.0.0.2) with three CPUs, so that
SPREAD, not a lack of room, puts the replicas on distinct nodes (asserted from each actor's node id and address).
Greedy outputs equal one in-process engine's with the summed pool; the router's map of each replica's blocks,
fed by its KV events over the actor's pipe, equals the replica's prefix cache, and a shared prefix goes where its
blocks are; each actor's ZMQ publisher replays to its replica's cache; streaming, abort and a client's disconnect
through AsyncLLMEngine; a replica's actor killed mid-run fails only its own requests, naming it and its node, the
rest completes with one engine's tokens, and the replica is started again in its bundle (its node) and serves.
DP=4 (two replicas per node) gives one engine's greedy tokens too. No KV block held on any replica after each test
(asked of the replicas). One cluster and one DP=2 engine for the module: nodes and replicas take seconds to start.

What this cannot show: a second host (tests/ray_clusters.py)."""

import asyncio
import re
import time

import msgpack
import psutil
import pytest
import ray
import zmq
from ray_clusters import alive_actors, loopback_cluster, node_ids, placed_groups
from test_data_parallel import GREEDY, prompts, tokens
from zmq.utils.monitor import recv_monitor_message

from tiffin import LLM, SamplingParams
from tiffin.engine.async_llm_engine import AsyncLLMEngine
from tiffin.engine.errors import EngineError
from tiffin.engine.outputs import EngineStats

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

NODES = {"127.0.0.1": 3, "127.0.0.2": 3}  # address: CPUs (room for DP=4 beside the module's DP=2)
BLOCK, BLOCKS = 4, 48  # per replica; the single engine gets both replicas' pools
ENGINE = dict(block_size=BLOCK, dtype="float32", max_num_seqs=8)
LONG = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster():
    with loopback_cluster(NODES) as nodes:
        yield nodes


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model("llama"))


@pytest.fixture(scope="module")
def single(model):
    llm = LLM(model, num_kv_blocks=2 * BLOCKS, **ENGINE)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def events_endpoint(tmp_path_factory) -> str:
    return f"ipc://{tmp_path_factory.mktemp('kv')}/events"  # replica r's: with _r appended (r > 0)


@pytest.fixture(scope="module")
def dp_llm(cluster, model, events_endpoint):
    llm = LLM(
        model,
        num_kv_blocks=BLOCKS,
        data_parallel_size=2,
        data_parallel_backend="ray",
        distributed_timeout=60,
        kv_events_endpoint=events_endpoint,
        kv_events_topic="kv",
        **ENGINE,
    )
    yield llm
    llm.shutdown()
    assert not alive_actors() and not placed_groups()  # every actor killed, the placement group removed


@pytest.fixture(scope="module")
def dp(dp_llm):
    return dp_llm.llm_engine


@pytest.fixture(scope="module")
def served(dp):
    engine = AsyncLLMEngine(dp)
    yield engine
    engine.shutdown()


def blocks_in_use(call) -> list[int]:
    """Each replica's KV blocks in use, asked of the replica (`call(rank, method)`: `dp._call`, or the served engine's
    call of it, as the thread driving `dp` must make it)."""
    return [call(rank, "stats").kv_blocks_used for rank in range(2)]


def test_replicas_on_two_nodes_match_one_engine(single, dp_llm, dp):
    nodes = node_ids()
    assert sorted(proc.address for proc in dp.procs) == sorted(NODES)
    for proc in dp.procs:
        assert nodes[proc.address] == proc.node_id
        assert "ReplicaActor" in " ".join(psutil.Process(proc.pid).cmdline())
    assert [h["node"] for h in dp.replica_health()] == [proc.address for proc in dp.procs]  # in /health
    ps = prompts(12, seed=0)
    assert tokens(dp_llm, ps) == tokens(single, ps)
    assert all(s.prompt_tokens > 0 for s in dp.replica_stats), "a replica served nothing"
    n2 = SamplingParams(temperature=0, max_tokens=5, n=2, ignore_eos=True)
    assert [[c.token_ids for c in o.outputs] for o in dp_llm.generate(ps[:3], n2, use_tqdm=False)] == [
        [c.token_ids for c in o.outputs] for o in single.generate(ps[:3], n2, use_tqdm=False)
    ]
    cached = [set(dp._call(rank, "block_manager.cached.copy")) for rank in range(2)]
    assert dp.router.blocks == cached and all(cached)  # the KV events came back over the actors' pipes
    assert not dp.requests and blocks_in_use(dp._call) == [0, 0]


def test_a_shared_prefix_goes_where_its_blocks_are(dp_llm, dp):
    system = prompts(1, seed=1, lens=(40,))[0]["prompt_token_ids"]
    tokens(dp_llm, [{"prompt_token_ids": system + [5, 6]}])
    before = [s.prefix_cache_hits for s in dp.replica_stats]
    for i in range(4):  # each the only request: loads are equal, so only the cache decides
        tokens(dp_llm, [{"prompt_token_ids": system + [7 + i] * 9}])
    hits = [s.prefix_cache_hits - b for s, b in zip(dp.replica_stats, before)]
    assert sorted(hits) == [0, 4 * 40], hits
    assert not dp.requests and blocks_in_use(dp._call) == [0, 0]


def test_each_replica_publishes_its_kv_events(dp_llm, dp, events_endpoint):
    """Each replica's actor publishes its KV events on ZMQ (subscribed once they run): after a reset (each replica's
    AllBlocksCleared), replaying each one's batches, read with plain msgpack as vLLM's format documents them
    ([ts, events, data_parallel_rank]), gives its prefix cache exactly."""
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED)
    try:
        for endpoint in (events_endpoint, f"{events_endpoint}_1"):
            sub.connect(endpoint)
        for _ in range(2):
            assert recv_monitor_message(monitor)["event"] == zmq.EVENT_CONNECTED
        sub.disable_monitor()
        time.sleep(0.5)  # the subscription, sent on connecting, reaches each PUB socket (ZMQ's "slow joiner")
        assert dp.reset_prefix_cache()
        tokens(dp_llm, prompts(6, seed=11))
        cached = [set(dp._call(rank, "block_manager.cached.copy")) for rank in range(2)]  # after its events went out
        held, cleared = [set(), set()], [False, False]
        while sub.poll(1000):
            _, _, payload = sub.recv_multipart()
            _, events, rank = msgpack.unpackb(payload)
            for tag, *fields in events:
                if tag == "AllBlocksCleared":
                    held[rank], cleared[rank] = set(), True
                elif tag == "BlockStored":
                    held[rank].update(fields[0])
                else:
                    held[rank].difference_update(fields[0])
    finally:
        monitor.close(0)
        sub.close(0)
        context.term()
    assert cleared == [True, True] and held == cached and all(cached)


async def settled(served, dp) -> list[EngineStats]:
    """Once every request's final output came back (an abort's comes after the replica freed its blocks): each
    replica's stats, asked of it."""
    deadline = time.monotonic() + 120
    while dp.requests:
        assert time.monotonic() < deadline, f"never finished: {list(dp.requests)}"  # a hang guard, not a timing bar
        await asyncio.sleep(0.01)
    return [await served._call_engine("_call", rank, "stats") for rank in range(2)]


def used(stats: list[EngineStats]) -> list[int]:
    return [s.kv_blocks_used for s in stats]


def test_streaming_abort_and_disconnect(served, dp, single):
    ps = prompts(3, seed=3, lens=(9, 17, 5))
    expected = tokens(single, ps[:1], LONG)[0]

    async def go():
        seen = [list(out.outputs[0].token_ids) async for out in served.generate(ps[0], LONG)]
        assert len(seen) > 1 and all(a == b[: len(a)] for a, b in zip(seen, seen[1:]))
        assert seen[-1] == expected
        stream = await served.add_request("abort-me", ps[1], LONG)
        async for out in stream:
            if out.outputs[0].token_ids:
                served.abort("abort-me")
            if out.finished:
                break
        assert out.outputs[0].finish_reason == "abort" and len(out.outputs[0].token_ids) < LONG.max_tokens
        # a client that goes away mid-stream (what an HTTP disconnect does: its task cancelled): its replica stops
        # generating for it well before max_tokens (the pool holds 192 tokens: it cannot run 10x longer)
        before = await settled(served, dp)
        disconnect = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
        task = asyncio.create_task(drain(served.generate(ps[2], disconnect, "gone")))
        while "gone" not in dp.requests or dp.requests["gone"].tokens <= len(ps[2]["prompt_token_ids"]):
            assert not task.done()
            await asyncio.sleep(0.001)  # until its replica reported outputs: it runs there
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        after = await settled(served, dp)
        generated = sum(a.generation_tokens - b.generation_tokens for a, b in zip(after, before))
        return generated, used(before), used(after)

    generated, *held = asyncio.run(go())
    assert 0 < generated < 100 and held == [[0, 0], [0, 0]], (generated, held)


async def drain(stream) -> list:
    return [out async for out in stream]


def test_a_killed_replica_actor_fails_only_its_requests_and_restarts(served, dp, single):
    """`ray.kill` of a replica's actor mid-run: exactly its requests in flight fail, each naming the replica and its
    node; a request sent meanwhile goes to the other; the rest complete with one engine's tokens. The replica is
    started again in its bundle (on its node), taken in and serves; the dead actor is gone."""
    ps = prompts(4, seed=4, lens=(4, 9, 6, 11))  # two on each replica, running together in its 192-token pool
    expected, fresh = tokens(single, ps, LONG), prompts(4, seed=8, lens=(5, 10))
    call = lambda *args: served._call_engine("_call", *args)

    async def run(prompt, params, request_id=None):
        try:
            return [out async for out in served.generate(prompt, params, request_id=request_id)][-1]
        except EngineError as e:
            return e

    async def go():
        tasks = [asyncio.create_task(run(p, LONG, f"kill-{i}")) for i, p in enumerate(ps)]
        generating = lambda routed: all(  # past its prompt: a routed request's load counts its outputs
            f"kill-{i}" in routed and routed[f"kill-{i}"].tokens > len(p["prompt_token_ids"]) for i, p in enumerate(ps)
        )
        while not generating(routed := dict(dp.requests)):
            assert not any(task.done() for task in tasks), "a request ended before every one was generating"
            await asyncio.sleep(0.001)
        victim = routed["kill-0"].replica
        old = dp.procs[victim]
        ray.kill(old.actor)
        killed = time.monotonic()
        while dp.dead[victim] is None:  # the engine thread saw it die: from now on nothing goes there
            await asyncio.sleep(0.01)
        during = asyncio.create_task(run(fresh[0], GREEDY, "during"))
        while "during" not in dp.requests and not during.done():
            await asyncio.sleep(0.001)
        sent_to = dp.requests["during"].replica if "during" in dp.requests else None
        results = await asyncio.gather(*tasks, during)
        deadline = time.monotonic() + 300
        while not dp.replica_health()[victim]["alive"]:
            assert time.monotonic() < deadline, "the replica never rejoined"  # a hang guard, not a timing bar
            await asyncio.sleep(0.05)
        print(f"replica {victim} rejoined {time.monotonic() - killed:.1f} s after its actor was killed")
        assert await call(victim, "block_manager.cached.copy") == {}  # taken in (an engine call does), empty
        after = await asyncio.gather(*(run(p, GREEDY) for p in fresh))
        return victim, old, routed, sent_to, results, after, used(await settled(served, dp))

    victim, old, routed, sent_to, (*results, during), after, held = asyncio.run(go())
    failed = {f"kill-{i}" for i, r in enumerate(results) if isinstance(r, EngineError)}
    assert failed == {rid for rid, r in routed.items() if r.replica == victim} and 0 < len(failed) < len(ps)
    named = f"data-parallel replica {victim} died (its Ray actor on node {old.address} ({old.node_id[:12]}) died: "
    assert all(re.search(re.escape(named) + r"\w+Error\)", str(r)) for r in results if isinstance(r, EngineError))
    print(next(r for r in results if isinstance(r, EngineError)))
    assert all(r.outputs[0].token_ids == expected[i] for i, r in enumerate(results) if f"kill-{i}" not in failed)
    assert sent_to == 1 - victim and during.outputs[0].token_ids == tokens(single, fresh[:1])[0]
    new = dp.procs[victim]
    assert new.actor != old.actor and (new.address, new.node_id) == (old.address, old.node_id)
    assert [o.outputs[0].token_ids for o in after] == tokens(single, fresh)
    assert dp.replica_stats[victim].prompt_tokens > 0, "the restarted replica served nothing"
    assert dp.replica_health()[victim]["restarts"] == 1 and dp.dead == [None, None] and served.ready
    assert held == [0, 0] and len(alive_actors()) == 2


def test_four_replicas_on_two_nodes_match_one_engine(cluster, model, single, dp_llm):
    """DP=4 over the two nodes (SPREAD places two replicas on each), beside the module's DP=2 engine (idle): one
    engine's greedy tokens, every replica serving, no block held after, nothing of it left after shutdown."""
    llm = LLM(
        model, num_kv_blocks=BLOCKS, data_parallel_size=4, data_parallel_backend="ray", distributed_timeout=60, **ENGINE
    )
    dp4 = llm.llm_engine
    try:
        assert sorted(proc.address for proc in dp4.procs) == sorted(list(NODES) * 2)
        ps = prompts(12, seed=12)
        assert tokens(llm, ps) == tokens(single, ps)
        assert all(s.prompt_tokens > 0 for s in dp4.replica_stats), "a replica served nothing"
        assert not dp4.requests and [dp4._call(rank, "stats").kv_blocks_used for rank in range(4)] == [0] * 4
    finally:
        llm.shutdown()
    assert len(alive_actors()) == 2 and len(placed_groups()) == 1  # the DP=2 engine's


def test_replicas_of_several_ranks_are_refused_by_name(model):
    with pytest.raises(ValueError, match="data_parallel_backend 'ray' runs CPU replicas of one rank each so far"):
        LLM(model, data_parallel_size=2, data_parallel_backend="ray", tensor_parallel_size=2)
