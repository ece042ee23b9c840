"""The `ray` executor: ranks 1..N-1 as actors of a Ray cluster, so that one group may span its nodes.

A placement group reserves one bundle per rank (CPU ranks: one CPU each), the first pinned to the engine's node
(rank 0 is the engine's process, which the bundle accounts for). Ranks follow the bundles' nodes, each node's
ranks contiguous (the engine's node first), so that a pipeline stage's tensor-parallel ranks share a node where
the placement allows. Each actor runs the `mp` executor's worker (`group._worker`), so both executors run one
worker code path: it listens at its node's address for rank 0's side channel (`multiprocessing.connection` over
TCP with a random auth key), joins the process group at rank 0's node's address (the engine's node, never
127.0.0.1 unless that is where rank 0 is), and binds its gloo connections to its own node's address.

A rank's liveness is its long-running `serve` call: an actor that dies (killed, its node removed) fails that
call, which the group's watcher and its diagnosis read, naming the rank and node. Stopping kills every actor and
removes the placement group.

Ray starts its workers at niceness 15; a rank takes the engine's back where the node permits it (`take_niceness`)."""

import os
import secrets
from multiprocessing.connection import Client, Listener

import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tiffin.engine.distributed import group
from tiffin.engine.errors import EngineDeadError


def join_cluster(config) -> None:
    """Join the Ray cluster at `ray_address` unless this process has joined one."""
    if not ray.is_initialized():
        ray.init(address=config.ray_address)


def take_niceness(niceness: int) -> None:
    """Run this thread (and the threads it starts) at the engine's `niceness`: Ray starts its workers at 15, which on
    a busy node starves the work every step waits for (where lowering it is not permitted, Ray's stays)."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, niceness)
    except PermissionError:
        pass


class NodeActor:
    """An actor the engine's process dials (a rank's, a data-parallel replica's: tiffin.engine.ray_replicas)."""

    def listen(self, authkey: bytes) -> tuple[str, str, int, tuple]:
        """Open a listener at this node's address: (node id, node address, pid, listener address)."""
        address = ray.util.get_node_ip_address()
        self.listener = Listener((address, 0), authkey=authkey)
        return ray.get_runtime_context().get_node_id(), address, os.getpid(), self.listener.address


class RankActor(NodeActor):
    """One rank's actor (`ray.remote`d in `start_workers`)."""

    def serve(
        self, config, rank: int, rendezvous: group.Rendezvous, niceness: int, threads: int, entry, args: tuple
    ) -> None:
        """Accept rank 0's connection, then run as this rank until told to stop (`group._worker`), at the engine's
        `niceness`."""
        take_niceness(niceness)
        conn = self.listener.accept()
        self.listener.close()
        group._worker(config, rank, rendezvous, conn, threads, entry, args)


class RayWorker:
    """A rank's actor as the group watches its workers (as `group.WorkerProcess`): `done` is its `serve` call."""

    def __init__(self, actor, done, node_id: str, address: str, pid: int, placement):
        self.actor, self.done, self.node_id, self.address, self.pid = actor, done, node_id, address, pid
        self.placement, self.killed = placement, False

    def join(self, timeout: float | None = None) -> None:
        if self.is_alive():
            ray.wait([self.done], timeout=timeout)

    def is_alive(self) -> bool:
        """Until killed, or until this process left the cluster (whose actors then ended): an actor whose `serve`
        returned stays up, holding its bundle, until `kill`."""
        return not self.killed and ray.is_initialized()

    def kill(self) -> None:
        self.killed = True
        ray.kill(self.actor)
        remove_placement_group(self.placement)  # the first worker's removes it; the others' find it removed

    def death(self) -> str | None:
        """How the actor died (named with its node), None while it runs or after it returned."""
        if not ray.is_initialized() or not ray.wait([self.done], timeout=0)[0]:
            return None
        try:
            ray.get(self.done)
        except RayError as e:
            return f"on node {self.address} ({self.node_id[:12]}) died ({type(e).__name__})"
        return None

    @staticmethod
    def wait_any(workers: list) -> None:
        ray.wait([w.done for w in workers], num_returns=1)


def start_workers(config, threads: int, entry, args: tuple) -> tuple[list, list[RayWorker], group.Rendezvous]:
    """Rank 0: place and start ranks 1..N-1 as actors, each running `entry` as `group._worker` does; their side
    channels, workers, and the rendezvous at this node's address."""
    join_cluster(config)
    here, address = ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()
    size = group.world_size(config)
    bundles = [{"CPU": 1.0} for _ in range(size)]
    bundles[0][f"node:{address}"] = 0.001  # rank 0's bundle on the engine's node
    placement = placement_group(bundles)
    try:
        ray.get(placement.ready(), timeout=config.distributed_timeout)
    except GetTimeoutError:
        remove_placement_group(placement)
        raise ValueError(
            f"the Ray cluster cannot place {size} ranks (one CPU each, rank 0 on this node {address}) within "
            f"distributed_timeout={config.distributed_timeout:g}s: it has {ray.available_resources()} free"
        ) from None
    nodes = placement_group_table(placement)["bundles_to_node_id"]
    # each node's ranks contiguous, the engine's node first
    order = sorted(range(1, size), key=lambda b: (nodes[b] != here, nodes[b], b))
    actor_cls = ray.remote(num_cpus=1)(RankActor)
    actors = [
        actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(placement, b)).remote() for b in order
    ]
    authkey, rendezvous = secrets.token_bytes(32), group.Rendezvous(address, group.free_port(address), address)
    conns, workers = [], []
    try:
        where = ray.get([a.listen.remote(authkey) for a in actors], timeout=group.START_TIMEOUT)
        niceness = os.getpriority(os.PRIO_PROCESS, 0)
        for rank, (actor, (node_id, node_address, pid, listening)) in enumerate(zip(actors, where), 1):
            at = rendezvous._replace(node_address=node_address)
            done = actor.serve.remote(config, rank, at, niceness, threads, entry, args)
            workers.append(RayWorker(actor, done, node_id, node_address, pid, placement))
            conns.append(Client(listening, authkey=authkey))
    except (RayError, GetTimeoutError, OSError, EOFError) as e:
        for actor in actors:
            ray.kill(actor)
        remove_placement_group(placement)
        raise EngineDeadError(f"the Ray executor's actors did not start: {type(e).__name__}: {e}") from e
    return conns, workers, rendezvous
