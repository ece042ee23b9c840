"""The `mp` executor over two nodes without Ray (nnodes / node_rank / master_addr / master_port), on one host: node 0
is the engine here at 127.0.0.1 (ranks 0..k-1), node 1 a headless `python -m tiffin.cli worker` process at
127.0.0.2 (ranks k..2k-1, its children). TP=2 and TP=2 x PP=2 spanning the nodes give the single-process engine's
greedy and seeded outputs (itself checked against transformers elsewhere). Every rank but the engine's listens at
its node's address only, the engine's rendezvous store at 127.0.0.1 only (not every address), every connection a
rank dialed reaches a socket that a rank of the group listens at, and node 1's side channels leave from 127.0.0.2
(gloo's and the store's dialing sockets are not bound: the kernel picks their source address). A node-1 rank
killed mid-stream fails every request in flight with an error naming the rank and node within distributed_timeout;
the headless process then exits and an engine starts again in the same process; a rank killed while the engine
idles is reported without a step.

What this cannot show: a second host (one kernel routes every loopback address; no firewall, no latency), GPUs
(nnodes > 1 refuses CUDA by name)."""

import asyncio
import os
import secrets
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
from distributed_runs import PARAMS, run

from tiffin import LLM, SamplingParams
from tiffin.engine.async_llm_engine import AsyncLLMEngine
from tiffin.engine.distributed.group import WorkerProcess, free_port
from tiffin.engine.distributed.multinode import RemoteRank
from tiffin.engine.errors import EngineError
from tiffin.engine.models.loader import get_model_config

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

HEAD, NODE = "127.0.0.1", "127.0.0.2"


@pytest.fixture(autouse=True)
def node_key(monkeypatch):
    monkeypatch.setenv("TIFFIN_NODE_KEY", secrets.token_hex(16))  # the headless process inherits it


def ports() -> int:
    """A master_port whose next port (the side channel) is free too."""
    while True:
        port = free_port(HEAD)
        try:
            with socket.create_server((HEAD, port + 1)):
                return port
        except OSError:
            continue


def headless(port: int, nnodes: int = 2, **env) -> subprocess.Popen:
    """Node 1's `tiffin worker`; its errors piped when `nnodes` or `env` make it one the engine refuses."""
    piped = nnodes != 2 or bool(env)
    cmd = [sys.executable, "-m", "tiffin.cli", "worker", "--nnodes", str(nnodes), "--node-rank", "1"]
    cmd += ["--master-addr", HEAD, "--master-port", str(port), "--node-ip-address", NODE]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **env}
    return subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE if piped else None, text=True)


def multinode(port: int, **kwargs) -> dict:
    return dict(nnodes=2, master_addr=HEAD, master_port=port, **kwargs)


@pytest.fixture(scope="module")
def expected(tiny_model) -> list[list[int]]:
    path = tiny_model("llama")
    return run(LLM(path, dtype="float32"), get_model_config(path).vocab_size)


def ip(address) -> str:
    return address.ip.removeprefix("::ffff:")


def assert_bound_to_nodes(group, node: subprocess.Popen, side_port: int) -> None:
    """Each rank but the engine's listens at its node's address only; each connection it dialed reaches a socket
    that a rank of the group listens at (so at that rank's node's address), the side channel's from node 1's own
    address. The engine's rendezvous store listens at 127.0.0.1 only."""
    remote = [w for w in group.procs if isinstance(w, RemoteRank)]
    local = [w for w in group.procs if isinstance(w, WorkerProcess)]
    size = len(group.procs) + 1
    assert [w.rank for w in remote] == list(range(size // 2, size)) and len(local) == size // 2 - 1
    assert {w.pid for w in remote} <= {p.pid for p in psutil.Process(node.pid).children()}  # node 1's processes
    ranks = [(os.getpid(), HEAD)] + [(w.pid, HEAD) for w in local] + [(w.pid, NODE) for w in remote]
    sockets = {pid: psutil.Process(pid).net_connections("tcp") for pid, _ in ranks}
    listening = {pid: {(ip(s.laddr), s.laddr.port) for s in sockets[pid] if not s.raddr} for pid, _ in ranks}
    everywhere = set().union(*listening.values(), {(HEAD, side_port)})  # the side channel's, closed once all joined
    assert {a for a, port in listening[os.getpid()] if port == group.rendezvous.port} == {HEAD}
    for pid, address in ranks[1:]:
        assert {a for a, _ in listening[pid]} == {address}, (pid, sockets[pid])
        for s in sockets[pid]:
            if s.raddr and (ip(s.laddr), s.laddr.port) not in listening[pid]:  # dialed, not accepted
                assert (ip(s.raddr), s.raddr.port) in everywhere, (pid, s)
                assert s.raddr.port != side_port or ip(s.laddr) == address, (pid, s)


@pytest.mark.parametrize("tp, pp", [(2, 1), (2, 2)], ids=["tp2", "tp2xpp2"])
def test_outputs_match_one_process_across_nodes(tiny_model, expected, tp, pp):
    path, port = tiny_model("llama"), ports()
    node = headless(port)
    try:
        llm = LLM(
            path,
            **multinode(port, dtype="float32", distributed_timeout=60),
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
        )
        group = llm.llm_engine.model_runner.group
        try:
            got = run(llm, get_model_config(path).vocab_size)
            assert_bound_to_nodes(group, node, port + 1)
        finally:
            llm.shutdown()
        assert node.wait(30) == 0  # the engine's shutdown ended node 1's ranks, and so the headless process
    finally:
        node.kill()
    assert got == expected


def test_killed_rank_fails_requests_in_flight(tiny_model):
    """Every request in flight ends with an error naming the rank and its node within distributed_timeout; the
    headless process exits; a new multi-node engine starts in the same process and serves; a rank of it killed
    while it idles is reported without a step."""
    path, port = tiny_model("llama"), ports()
    node = headless(port)

    async def main() -> None:
        engine = AsyncLLMEngine.from_engine_args(path, **multinode(port, tensor_parallel_size=2, distributed_timeout=5))
        try:
            params = SamplingParams(max_tokens=900, ignore_eos=True)
            streams = [await engine.add_request(f"r{i}", [5, 6, 7 + i], params) for i in range(3)]
            for stream in streams:
                await stream.__anext__()  # running
            (rank,) = engine.engine.model_runner.group.procs
            os.kill(rank.pid, signal.SIGKILL)
            start = time.monotonic()
            for stream in streams:
                with pytest.raises(EngineError, match=rf"rank 1 on node {NODE} \(pid {rank.pid}\) died"):
                    async for _ in stream:
                        pass
            assert time.monotonic() - start < 5 and not engine.healthy
        finally:
            engine.shutdown()

    try:
        asyncio.run(main())
        assert node.wait(30) != 0
    finally:
        node.kill()
    port = ports()
    node = headless(port)
    try:
        llm = LLM(path, **multinode(port, tensor_parallel_size=2))
        try:
            assert len(run(llm, get_model_config(path).vocab_size)) == len(PARAMS)
            # killed while idle: the group's watcher reports it without a step
            (rank,) = llm.llm_engine.model_runner.group.procs
            os.kill(rank.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while llm.llm_engine.failure() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert f"rank 1 on node {NODE} (pid {rank.pid}) died" in (llm.llm_engine.failure() or "")
        finally:
            llm.shutdown()
        assert node.wait(30) != 0
    finally:
        node.kill()


def test_bad_node_settings_are_refused_by_name(tiny_model):
    path = tiny_model("llama")
    with pytest.raises(ValueError, match=r"nnodes 2 must divide tensor_parallel_size x pipeline_parallel_size \(3\)"):
        LLM(path, tensor_parallel_size=3, nnodes=2)
    with pytest.raises(ValueError, match="node_rank 1: the engine runs on node 0"):
        LLM(path, tensor_parallel_size=2, nnodes=2, node_rank=1)
    with pytest.raises(ValueError, match="the ray executor places ranks itself"):
        LLM(path, tensor_parallel_size=2, nnodes=2, distributed_executor_backend="ray")


def test_mismatched_nodes_are_refused_by_name(tiny_model):
    """A headless node started with another nnodes, or another TIFFIN_NODE_KEY, is refused and exits with the
    reason; the engine takes the right node meanwhile."""
    path, port = tiny_model("llama"), ports()
    wrong = headless(port, nnodes=3), headless(port, TIFFIN_NODE_KEY="another")
    node = headless(port)
    try:
        llm = LLM(path, **multinode(port, tensor_parallel_size=2))
        try:
            assert len(run(llm, get_model_config(path).vocab_size)) == len(PARAMS)
        finally:
            llm.shutdown()
        assert node.wait(30) == 0
        errors = [p.communicate(timeout=30)[1] for p in wrong]
        assert [p.returncode for p in wrong] == [1, 1]
        assert "node 1 was started with nnodes 3; the engine runs nnodes 2" in errors[0]
        assert "refused this node (TIFFIN_NODE_KEY differs?)" in errors[1]
    finally:
        for p in (node, *wrong):
            p.kill()
