"""The Ray executor (`distributed_executor_backend="ray"`) over a Ray cluster of three nodes started here, on one
host: each node a raylet at its own loopback address (127.0.0.1, 127.0.0.2, 127.0.0.3) with its own CPUs (1, 1, 2),
the engine (rank 0) on the first. Rank 0's bundle takes the first node's only CPU, so every other rank lands on
another node: TP=2 and TP=2 x PP=2 span nodes (asserted from each actor's node id and address), and their greedy
and seeded outputs equal the single-process engine's (itself checked against transformers elsewhere). Each actor's
gloo connections listen at its node's address, and it dials rank 0 at rank 0's. A killed actor fails every request
in flight with an error naming its rank and node within distributed_timeout, leaves no actor or placement group,
and the engine starts again in the same process; one killed while the engine idles is reported without a step.
One cluster for the module: a node costs seconds to start.

What this cannot show: a second host (tests/ray_clusters.py), or GPUs (CPU ranks only; the executor refuses CUDA by
name)."""

import asyncio
import itertools
import time

import psutil
import pytest
import ray
from distributed_runs import PARAMS, run
from ray_clusters import alive_actors, loopback_cluster, node_ids, placed_groups

from tiffin import LLM, SamplingParams
from tiffin.engine.async_llm_engine import AsyncLLMEngine
from tiffin.engine.errors import EngineError
from tiffin.engine.models.loader import get_model_config

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

NODES = {"127.0.0.1": 1, "127.0.0.2": 1, "127.0.0.3": 2}  # address: CPUs


@pytest.fixture(scope="module")
def cluster():
    with loopback_cluster(NODES) as nodes:
        yield nodes


def assert_placed(workers: list, size: int) -> None:
    """Every rank on another node than rank 0's, its actor at that node's address (node id and address as the actor
    read them); each node's ranks contiguous."""
    nodes = node_ids()
    assert len(workers) == size - 1
    for worker in workers:
        assert worker.address != "127.0.0.1" and nodes[worker.address] == worker.node_id
        assert "RankActor" in " ".join(psutil.Process(worker.pid).cmdline())
    addresses = [w.address for w in workers]
    assert len(list(itertools.groupby(addresses))) == len(set(addresses)), addresses
    if size == 4:  # the second node holds one CPU, the third two
        assert sorted(addresses) == ["127.0.0.2", "127.0.0.3", "127.0.0.3"]


def assert_bound_to_nodes(workers: list, store_port: int) -> None:
    """Each actor listens (gloo's connections) at its node's address only, never 127.0.0.1 (Ray's own server of the
    actor aside); it dialed the rendezvous store at rank 0's node's address."""
    ray_ports = {a["ActorID"]: a["Address"]["Port"] for a in ray._private.state.actors().values()}
    for worker in workers:
        sockets = psutil.Process(worker.pid).net_connections("tcp")
        ray_port = ray_ports[worker.actor._actor_id.hex()]
        listening = {ip(s.laddr) for s in sockets if s.status == psutil.CONN_LISTEN and s.laddr.port != ray_port}
        assert listening == {worker.address}, (worker.address, sockets)
        assert {ip(s.raddr) for s in sockets if s.raddr and s.raddr.port == store_port} == {"127.0.0.1"}, sockets


def ip(address) -> str:
    return address.ip.removeprefix("::ffff:")


@pytest.mark.parametrize("tp, pp", [(2, 1), (2, 2)], ids=["tp2", "tp2xpp2"])
def test_outputs_match_one_process_across_nodes(cluster, tiny_model, tp, pp):
    path = tiny_model("llama")
    vocab = get_model_config(path).vocab_size
    expected = run(LLM(path, dtype="float32"), vocab)
    llm = LLM(
        path,
        dtype="float32",
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        distributed_executor_backend="ray",
        distributed_timeout=60,
    )
    group = llm.llm_engine.model_runner.group
    try:
        assert_placed(group.procs, tp * pp)
        got = run(llm, vocab)
        assert_bound_to_nodes(group.procs, group.rendezvous.port)
    finally:
        llm.shutdown()
    assert got == expected
    assert not alive_actors() and not placed_groups()


def test_killed_actor_fails_requests_in_flight(cluster, tiny_model):
    """Every request in flight ends with an error naming the rank and its node within distributed_timeout; no actor
    or placement group is left; a new engine starts in the same process and serves."""
    path = tiny_model("llama")

    async def main() -> None:
        engine = AsyncLLMEngine.from_engine_args(
            path, tensor_parallel_size=2, distributed_executor_backend="ray", distributed_timeout=5
        )
        worker = engine.engine.model_runner.group.procs[0]
        try:
            params = SamplingParams(max_tokens=900, ignore_eos=True)
            streams = [await engine.add_request(f"r{i}", [5, 6, 7 + i], params) for i in range(3)]
            for stream in streams:
                await stream.__anext__()  # running
            ray.kill(worker.actor)
            start = time.monotonic()
            for stream in streams:
                with pytest.raises(EngineError, match=rf"rank 1 on node {worker.address} .* died"):
                    async for _ in stream:
                        pass
            assert time.monotonic() - start < 5 and not engine.healthy
        finally:
            engine.shutdown()

    asyncio.run(main())
    assert not alive_actors() and not placed_groups()
    llm = LLM(path, tensor_parallel_size=2, distributed_executor_backend="ray")
    try:
        assert len(run(llm, get_model_config(path).vocab_size)) == len(PARAMS)
        # killed while idle: the group's watcher reports it without a step
        worker = llm.llm_engine.model_runner.group.procs[0]
        ray.kill(worker.actor)
        deadline = time.monotonic() + 10
        while llm.llm_engine.failure() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert f"rank 1 on node {worker.address}" in (llm.llm_engine.failure() or "")
    finally:
        llm.shutdown()
    assert not alive_actors() and not placed_groups()


def test_removed_node_fails_requests_in_flight(cluster, tiny_model):
    """The node of rank 1 removed mid-stream (its raylet and workers end): the requests in flight get the error
    naming the rank and node within distributed_timeout. The node is added back for the module's other tests."""
    path = tiny_model("llama")

    async def main() -> None:
        engine = AsyncLLMEngine.from_engine_args(
            path, tensor_parallel_size=2, distributed_executor_backend="ray", distributed_timeout=5
        )
        worker = engine.engine.model_runner.group.procs[0]
        node = next(n for n in cluster.list_all_nodes() if n.node_ip_address == worker.address)
        try:
            params = SamplingParams(max_tokens=900, ignore_eos=True)
            streams = [await engine.add_request(f"r{i}", [5, 6, 7 + i], params) for i in range(2)]
            for stream in streams:
                await stream.__anext__()
            start = time.monotonic()
            cluster.remove_node(node)
            for stream in streams:
                with pytest.raises(EngineError, match=rf"rank 1 on node {worker.address} .* died"):
                    async for _ in stream:
                        pass
            assert time.monotonic() - start < 5 and not engine.healthy
        finally:
            engine.shutdown()
            cluster.add_node(node_ip_address=worker.address, num_cpus=NODES[worker.address])

    asyncio.run(main())
    assert not alive_actors() and not placed_groups()


def test_unknown_executor_is_refused_by_name(tiny_model):
    with pytest.raises(ValueError, match="distributed_executor_backend must be 'mp' or 'ray', got 'slurm'"):
        LLM(tiny_model("llama"), tensor_parallel_size=2, distributed_executor_backend="slurm")
