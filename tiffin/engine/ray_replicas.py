"""Data-parallel replicas as actors of a Ray cluster (`data_parallel_backend="ray"`, vLLM's name), so that the
replicas of one engine may sit on several nodes. The front (tiffin.engine.data_parallel), its router and the
supervisor (tiffin.engine.replica_supervisor) drive them as they drive the `mp` backend's processes.

One placement group holds a one-CPU bundle per replica, SPREAD: the replicas land on distinct nodes while the cluster
has room for that, else share nodes. Replica r's actor runs in bundle r, also when it is started again (its dead
actor killed first, which frees the bundle), so a replica restarts on its node (on another only if Ray moved the
bundle, its node gone). The actor listens at its node's address; the front dials it twice
(`multiprocessing.connection` over TCP, a random auth key): the replica's pipe, carrying what an `mp` replica's carries
(tiffin.engine.data_parallel_replica), then a liveness connection that carries nothing, so that it reads as closed once
the actor's process is gone (killed, crashed, its node removed: the kernel closes its sockets). The supervisor's
watcher waits on it as on a process's sentinel. A node that hangs with its sockets open is not seen dead.

Each replica runs torch with the `mp` replicas' share of this host's threads; its KV events go to the front with its
outputs and, with `kv_events_endpoint` set, out of its own socket on its node (the port moved up by its rank). CPU
replicas of one rank each so far (refused otherwise, by name)."""

import os
import secrets
from multiprocessing.connection import Client, Connection

import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tiffin.engine.config import EngineConfig
from tiffin.engine.data_parallel_replica import replica_main
from tiffin.engine.distributed.join import world_size
from tiffin.engine.distributed.ray_executor import NodeActor, join_cluster, take_niceness

CAUSE_WAIT = 2.0  # seconds to wait for Ray's word on how an actor whose connection closed ended


class ReplicaActor(NodeActor):
    """One replica's actor (`ray.remote`d by `RayReplicas`)."""

    def serve(self, config: EngineConfig, rank: int, threads: int, endpoint: str | None, topic: str, niceness: int):
        """Accept the front's pipe, then its liveness connection; run the replica until the front stops it."""
        take_niceness(niceness)
        conn = self.listener.accept()
        alive = self.listener.accept()
        self.listener.close()
        try:
            replica_main(config, rank, conn, threads, endpoint, topic)
        finally:
            conn.close()
            alive.close()


class RayReplica:
    """A replica's actor as the supervisor and the front watch a replica's process (`sentinel`, `is_alive`, `join`,
    `kill`, and `cause` in place of an exit code). Joining it once its connection closed kills the actor (whose
    `serve` may have returned, the actor still holding its bundle), as joining a process reaps it."""

    def __init__(self, actor, done, alive: Connection, node_id: str, address: str, pid: int):
        self.actor, self.done, self.sentinel = actor, done, alive
        self.node_id, self.address, self.pid, self.killed = node_id, address, pid, False

    def is_alive(self) -> bool:
        return not self.killed and not self.sentinel.poll(0)

    def join(self, timeout: float | None = None) -> None:
        if self.killed or self.sentinel.poll(timeout):
            self.kill()

    def kill(self) -> None:
        if not self.killed and ray.is_initialized():
            ray.kill(self.actor)
        self.killed = True

    def cause(self) -> str:
        """How the actor ended, named with its node (Ray's error for it, once Ray knows)."""
        where = f"its Ray actor on node {self.address} ({self.node_id[:12]})"
        if not ray.is_initialized() or not ray.wait([self.done], timeout=CAUSE_WAIT)[0]:
            return f"{where} closed its connection"
        try:
            ray.get(self.done)
        except RayError as e:
            return f"{where} died: {type(e).__name__}"
        return f"{where} stopped"


class RayReplicas:
    """`start(rank)` for the supervisor: replica `rank`'s actor started in its bundle, its pipe and its `RayReplica`;
    `close` removes the placement group (after the supervisor stopped the actors)."""

    def __init__(self, config: EngineConfig, threads: int, replica_config):
        if world_size(config) > 1 or config.torch_device.type != "cpu":
            raise ValueError(
                "data_parallel_backend 'ray' runs CPU replicas of one rank each so far (tensor_parallel_size and "
                f"pipeline_parallel_size 1, device cpu), got {world_size(config)} ranks on {config.torch_device}"
            )
        join_cluster(config)
        self.config, self.threads, self.replica_config = config, threads, replica_config
        n, self.timeout = config.data_parallel_size, config.distributed_timeout
        self.placement = placement_group([{"CPU": 1.0}] * n, strategy="SPREAD")
        try:
            ray.get(self.placement.ready(), timeout=self.timeout)
        except GetTimeoutError:
            self.close()
            raise ValueError(
                f"the Ray cluster cannot place {n} data-parallel replicas (one CPU each) within distributed_timeout="
                f"{self.timeout:g}s: it has {ray.available_resources()} free"
            ) from None
        self.actors: dict[int, object] = {}  # each rank's latest actor
        self._cls = ray.remote(num_cpus=1)(ReplicaActor)

    def __call__(self, rank: int) -> tuple[Connection, RayReplica]:
        """Start replica `rank` (RuntimeError naming it if its actor does not start)."""
        if rank in self.actors:  # its dead actor, whose bundle the new one takes
            ray.kill(self.actors[rank])
        strategy = PlacementGroupSchedulingStrategy(self.placement, rank)
        actor = self.actors[rank] = self._cls.options(scheduling_strategy=strategy).remote()
        authkey, config = secrets.token_bytes(32), self.config
        try:
            node_id, address, pid, listening = ray.get(actor.listen.remote(authkey), timeout=self.timeout)
            niceness = os.getpriority(os.PRIO_PROCESS, 0)
            args = (self.replica_config(config, rank), rank, self.threads, config.kv_events_endpoint)
            done = actor.serve.remote(*args, config.kv_events_topic, niceness)
            conn, alive = Client(listening, authkey=authkey), Client(listening, authkey=authkey)
        except (RayError, GetTimeoutError, OSError, EOFError) as e:
            ray.kill(actor)
            raise RuntimeError(
                f"data-parallel replica {rank}'s Ray actor did not start: {type(e).__name__}: {e}"
            ) from None
        return conn, RayReplica(actor, done, alive, node_id, address, pid)

    def close(self) -> None:
        if ray.is_initialized():
            remove_placement_group(self.placement)
