"""The `mp` executor across nodes, without Ray (vLLM's `--nnodes`, `--node-rank`, `--master-addr`, `--master-port`):
world size / nnodes consecutive ranks per node; node 0's are the engine's (rank 0 and the processes it spawns, as
on one host), each other node's are started by a headless `tiffin worker` process there (`serve_node`).

Every rank joins the process group at master_addr:master_port and binds its gloo connections to its node's address
(node 0: master_addr; another node: its `node_address`, by default the one this host routes to master_addr from),
so that no rank binds or dials 127.0.0.1 unless its peer is there. Rank 0 listens at master_addr:master_port + 1 for
the side channel (`multiprocessing.connection`'s protocol, authenticated with TIFFIN_NODE_KEY, the same on every
node): a headless node dials it first for what to run (the engine's config, the entry point and its arguments, its
ranks; so nothing but the model's path must agree by hand), then each of its ranks dials twice: once for its
channel (the group's `conns`) and once for its liveness, a connection that carries nothing and so turns readable
only when the rank's process is gone, which the group's watcher and diagnosis read, naming the rank and node."""

import os
import socket
import struct
import time
from multiprocessing.connection import AuthenticationError, Connection, answer_challenge, deliver_challenge

import torch.multiprocessing as mp

from tiffin.engine.distributed import group
from tiffin.engine.errors import EngineDeadError

HANDSHAKE_TIMEOUT = 10.0  # seconds a dialer may take to authenticate and say who it is


class RemoteRank:
    """A rank on another node as the group watches its workers (as `group.WorkerProcess`): alive while its liveness
    connection is open. Rank 0 cannot kill it: closing its channel (`group._stop`) ends it."""

    def __init__(self, rank: int, conn: Connection, alive: Connection, address: str, pid: int):
        self.rank, self.conn, self.sentinel, self.address, self.pid = rank, conn, alive, address, pid
        self.killed = False

    wait_any = staticmethod(group.WorkerProcess.wait_any)

    def join(self, timeout: float | None = None) -> None:
        if not self.killed:
            self.sentinel.poll(timeout)

    def is_alive(self) -> bool:
        return not self.killed and not self.sentinel.poll(0)

    def kill(self) -> None:
        """Stop watching it: the liveness connection shut (which also wakes a watcher waiting on it)."""
        self.killed = True
        with socket.socket(fileno=os.dup(self.sentinel.fileno())) as s:
            s.shutdown(socket.SHUT_RDWR)

    def death(self) -> str | None:
        if self.is_alive() or self.killed:
            return None
        return f"on node {self.address} (pid {self.pid}) died (its connection closed)"


def authkey() -> bytes:
    return os.environ.get("TIFFIN_NODE_KEY", "tiffin").encode()


def start_workers(config, threads: int, entry, args: tuple) -> tuple[list, list, group.Rendezvous]:
    """Rank 0: spawn this node's ranks, then take the other nodes' as they dial in (within START_TIMEOUT); their
    side channels, workers, and the rendezvous at master_addr."""
    address, port = config.master_addr, config.master_port
    rendezvous = group.Rendezvous(address, port, address)
    try:
        server = socket.create_server((address, port + 1))
    except OSError as e:
        raise ValueError(f"nnodes > 1: cannot listen at master_addr {address} port {port + 1}: {e}") from None
    with server:
        conns, procs, _ = group.spawn(config, threads, entry, args, rendezvous)
        try:
            remote = _accept(server, config, (config, threads, entry, args))
        except BaseException:
            group._stop(conns, procs, grace=0)
            raise
    return conns + [r.conn for r in remote], procs + remote, rendezvous


def _accept(server: socket.socket, config, work: tuple) -> list[RemoteRank]:
    per_node = group.world_size(config) // config.nnodes
    ranks = range(per_node, group.world_size(config))
    deadline = time.monotonic() + group.START_TIMEOUT
    channels, alive, nodes = {}, {}, set()
    while len(channels) < len(ranks) or len(alive) < len(ranks):
        server.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            sock, _ = server.accept()
        except TimeoutError:
            for conn in [c for c, *_ in channels.values()] + list(alive.values()):
                conn.close()  # the ranks that joined see their channel close and exit
            missing = sorted({r // per_node for r in ranks if r not in channels or r not in alive})
            raise EngineDeadError(
                f"node(s) {missing} did not join at {config.master_addr}:{config.master_port + 1} within "
                f"{group.START_TIMEOUT:.0f}s: start `tiffin worker --node-rank N --master-addr {config.master_addr} "
                f"--master-port {config.master_port}` on each"
            ) from None
        if (shaken := _handshake(sock)) is None:
            continue
        conn, (kind, index, *rest) = shaken
        if kind == "node":
            if not (error := _node_error(config, index, rest[0], nodes)):
                nodes.add(index)
            conn.send(
                ("error", error) if error else ("run", work, list(range(index * per_node, (index + 1) * per_node)))
            )
            conn.close()
        elif kind == "rank" and index in ranks:
            channels[index] = (conn, *rest)
        elif kind == "alive" and index in ranks:
            alive[index] = conn
        else:
            conn.close()
    return [RemoteRank(r, channels[r][0], alive[r], *channels[r][1:]) for r in ranks]


def _node_error(config, index: int, nnodes: int, seen: set) -> str | None:
    if nnodes != config.nnodes:
        return f"node {index} was started with nnodes {nnodes}; the engine runs nnodes {config.nnodes}"
    if not 1 <= index < config.nnodes or index in seen:
        return f"node_rank {index} is not one of the engine's headless nodes left (1..{config.nnodes - 1})"
    return None


def _handshake(sock: socket.socket, hello: tuple | None = None) -> tuple[Connection, tuple] | None:
    """`sock` as a connection authenticated both ways, and the hello: sent (a dialer's, given) or received (rank 0's
    side); None, the socket closed, when the peer fails it or stays silent for HANDSHAKE_TIMEOUT."""
    sock.settimeout(None)  # the connection reads a blocking descriptor; a receive timeout bounds the handshake
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(HANDSHAKE_TIMEOUT), 0))
    conn = Connection(os.dup(sock.fileno()))
    steps = (deliver_challenge, answer_challenge) if hello is None else (answer_challenge, deliver_challenge)
    try:
        for step in steps:
            step(conn, authkey())
        if hello is None:
            hello = conn.recv()
        else:
            conn.send(hello)
    except (AuthenticationError, OSError, EOFError):
        conn.close()
        return None
    finally:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))  # the channel waits idle
        sock.close()  # the connection holds its own descriptor of the socket
    return conn, hello


def _dial(master: tuple[str, int], node_address: str, hello: tuple, deadline: float) -> Connection:
    """A connection to rank 0's side channel from `node_address`, retried until `deadline` (the engine may start
    after this node)."""
    while True:
        try:
            sock = socket.create_connection(master, HANDSHAKE_TIMEOUT, source_address=(node_address, 0))
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
            continue
        if (shaken := _handshake(sock, hello)) is None:
            raise ConnectionError(f"rank 0 at {master[0]}:{master[1]} refused this node (TIFFIN_NODE_KEY differs?)")
        return shaken[0]


def route_address(master_addr: str) -> str:
    """This host's address on the route to `master_addr` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master_addr, 1))
        return s.getsockname()[0]


def serve_node(node_rank: int, nnodes: int, master_addr: str, master_port: int, node_address: str | None = None) -> int:
    """A headless node (`tiffin worker`): ask rank 0 what to run, start this node's ranks, wait for them to end
    (the engine's shutdown ends them); the worst exit code."""
    node_address = node_address or route_address(master_addr)
    master, deadline = (master_addr, master_port + 1), time.monotonic() + group.START_TIMEOUT
    with _dial(master, node_address, ("node", node_rank, nnodes), deadline) as conn:
        reply = conn.recv()
    if reply[0] == "error":
        raise ValueError(reply[1])
    _, (config, threads, entry, args), ranks = reply
    rendezvous = group.Rendezvous(master_addr, master_port, node_address)
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=_rank, args=(master, config, rank, rendezvous, threads, entry, args), name=f"tiffin-rank{rank}"
        )
        for rank in ranks
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    return max(abs(proc.exitcode) for proc in procs)


def _rank(master: tuple, config, rank: int, rendezvous: group.Rendezvous, threads: int, entry, args: tuple) -> None:
    """A headless node's rank: its channel and liveness connections to rank 0, then the group's worker."""
    deadline = time.monotonic() + group.START_TIMEOUT
    conn = _dial(master, rendezvous.node_address, ("rank", rank, rendezvous.node_address, os.getpid()), deadline)
    alive = _dial(master, rendezvous.node_address, ("alive", rank), deadline)
    group._worker(config, rank, rendezvous, conn, threads, entry, args)
    alive.close()
