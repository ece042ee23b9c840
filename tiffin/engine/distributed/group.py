"""A group of ranks serving one model: split across `tensor_parallel_size` ranks within each of
`pipeline_parallel_size` stages, one process per rank (vLLM's and nano-vllm's scheme; ranks numbered as
`distributed.pipeline` says).

Rank 0 is the engine's own process: it schedules, builds each step's flattened batch, broadcasts it, samples
and detokenizes. Ranks 1..N-1 are worker processes started here (`torch.multiprocessing` spawn: the `mp`
executor, `spawn`; on other nodes, `multinode`'s headless processes) or actors of a Ray cluster (the `ray` one,
`ray_executor`); either way each runs `_worker`, then the entry point it is given, which loads its shard and
loops: wait for the doorbell, receive the step, run the forward. torch.distributed runs the collectives: NCCL on
CUDA, gloo on CPU, every one bounded by `distributed_timeout` (`join`: how a rank joins). This module knows nothing
of what a step holds (`wire` carries it).

A per-worker connection (a pipe; over TCP with an auth key under Ray or from another node) carries what must
not wait on a collective: the doorbell (so an idle engine never times a collective out), the KV block count agreed
at start, a worker's start-up error, commands between steps (sleep, wake, weight reload) and their answers, and the
stop; a worker whose engine process dies sees the connection close and exits.

Under pipeline parallelism the step goes to each worker point to point, not waited on (`isend`): gloo's sends wait
for their receiver, and a stage still computing an earlier batch (`pipelined`) receives it when it gets there.

Invariant: every rank runs the same step in the same order; a collective that fails makes the group broken,
naming the rank; shutdown (or the engine process's death, closing the pipe) ends every worker.
"""

import os
import pickle
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import wait
from multiprocessing.context import SpawnProcess
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tiffin.engine.distributed import wire
from tiffin.engine.distributed.join import (
    Rendezvous,
    batches_in_flight,
    free_port,
    init_group,
    rank_device,
    ranks,
    world_size,
)
from tiffin.engine.distributed.pipeline import UNSTAGED, PipelineParallel
from tiffin.engine.distributed.tensor_parallel import TensorParallel
from tiffin.engine.errors import EngineDeadError

START_TIMEOUT = 600.0  # seconds a worker may take to load its shard
# seconds a failed step waits for a worker's death to show: a peer that closed the connection may still be exiting
# (beside a busy suite on 2 cores, reaping a SIGKILLed worker took over the 1 s once given)
DEATH_GRACE = 3.0
STEP_TAG = 1  # point-to-point messages of a step's values (hidden states and logits: tag 0)


class Command(NamedTuple):
    """What every rank runs between steps (sleep, wake, weight reload): `name` of a function of the rank's runner,
    with `args`."""

    name: str
    args: tuple


class WorkerProcess(SpawnProcess):
    """A worker of the `mp` executor, as the group watches its workers (`ray_executor.RayWorker` the same)."""

    def death(self) -> str | None:
        """How it died; None while it runs."""
        return None if self.exitcode is None else f"died (exit code {self.exitcode})"

    @staticmethod
    def wait_any(workers: list) -> None:
        """Block until one of `workers` exits."""
        wait([w.sentinel for w in workers])


class WorkerGroup:
    """The group's collectives and, on rank 0, its worker processes."""

    def __init__(
        self,
        tp: TensorParallel,
        device: torch.device,
        timeout: float,
        conns: list,
        procs: list = (),
        pp: PipelineParallel = UNSTAGED,
    ):
        self.tp, self.pp, self.device, self.timeout = tp, pp, device, timeout
        self.conns, self.procs = conns, list(procs)  # rank 0: one per worker; a worker: its pipe to rank 0
        self.broken: str | None = None  # rank 0: why the group cannot run another step
        self.busy_s = 0.0  # seconds this rank spent computing its part of steps (`busy`), as its runner counts
        self.wait_s = 0.0  # rank 0 under pipeline parallelism: seconds spent waiting for the last stage's logits
        self.sends: deque = deque()  # (work, tensor) of sends not waited on (`isend`), the tensor kept meanwhile
        self.stopping = False

    @classmethod
    def start(
        cls, config, device: torch.device, entry: Callable, args: tuple, launch: Callable | None = None
    ) -> "WorkerGroup":
        """Rank 0: start ranks 1..N-1 with `launch` (`spawn`, the default: processes; `ray_executor.start_workers`:
        Ray actors), each running `entry(group, *args)` (which loads its shard meanwhile); join the process group."""
        size = world_size(config)
        last = rank_device(device, size - 1)
        if device.type == "cuda" and torch.cuda.device_count() <= last.index:
            raise ValueError(
                f"{size} ranks (tensor x pipeline parallel) on {rank_device(device, 0)} need {rank_device(device, 0)}"
                f" and {last}"
                f"{' and the GPUs between' if size > 2 else ''}: {torch.cuda.device_count()} are visible"
            )
        if dist.is_initialized():
            raise RuntimeError("a multi-process engine already runs in this process; shut it down first")
        if config.distributed_executor_backend == "ray" and device.type != "cpu":
            raise ValueError(f"distributed_executor_backend 'ray' runs CPU (gloo) ranks only so far, not on {device}")
        if config.nnodes > 1 and device.type != "cpu":
            raise ValueError(f"nnodes > 1 runs CPU (gloo) ranks only so far, not on {device}")
        threads = torch.get_num_threads()
        if device.type == "cpu":  # a stage's ranks share the CPUs; so do the stages, unless they take turns
            sharing = world_size(config) if batches_in_flight(config) > 1 else config.tensor_parallel_size
            torch.set_num_threads(max(1, threads // sharing))
        conns, procs, rendezvous = (launch or spawn)(config, torch.get_num_threads(), entry, args)
        tp, pp = ranks(config, 0)
        self = cls(tp, device, config.distributed_timeout, conns, procs, pp)
        self.rendezvous = rendezvous
        self.threads = threads  # given back at shutdown
        weakref.finalize(self, _stop, conns, procs)  # no orphan workers, even if the engine is never shut down
        threading.Thread(target=_watch, args=(weakref.ref(self),), name="tiffin-tp-watch", daemon=True).start()
        try:
            for rank, conn in enumerate(conns, 1):  # imports done: the group forms within distributed_timeout
                self._receive(conn, rank)
            self.tp, self.pp = init_group(config, 0, rendezvous)
        except Exception as e:
            # torch counts default groups from the start of a join: a failed one would leave this process's
            # count ahead of the next engine's fresh workers, whose joins would then never meet it
            dist.distributed_c10d._world.group_count = 0
            self.shutdown()
            if isinstance(e, (EngineDeadError, ValueError)):
                raise
            raise EngineDeadError(self._diagnose(e)) from e
        return self

    @property
    def kind(self) -> str:
        """What errors call the group's ranks."""
        return "tensor-parallel" if self.pp.size == 1 else "pipeline-parallel"

    @property
    def rank(self) -> int:
        """This process's rank in the whole group (0: the engine's)."""
        return self.pp.rank * self.tp.size + self.tp.rank

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's `value` (the KV block count all can hold, the SM count all warm up for);
        every rank calls it at the same point of its start. On rank 0, a worker's start-up error raised."""
        if self.rank:
            self.conns[0].send(("ready", value))
            return self.conns[0].recv()
        values = [value] + [self._receive(conn, rank)[1] for rank, conn in enumerate(self.conns, 1)]
        for conn in self.conns:
            conn.send(min(values))
        return min(values)

    def _receive(self, conn, rank: int) -> tuple:
        """A starting worker's next message; its start-up error (or death, or silence) raised, workers ended."""
        if not conn.poll(START_TIMEOUT):
            self.shutdown()
            raise EngineDeadError(f"{self.kind} rank {rank} did not start within {START_TIMEOUT:.0f}s")
        try:
            reply = conn.recv()
        except EOFError:
            self.shutdown()
            raise EngineDeadError(f"{self.kind} rank {rank} died while starting") from None
        if reply[0] == "error":
            self.shutdown()
            raise ValueError(f"{self.kind} rank {rank}: {reply[1]}")
        return reply

    def run(self, values: list, extra: object, forward: Callable[[], object]):
        """Rank 0: send a step (`values` in the wire format, `extra` any picklable object or None) and run
        `forward()`. A failure from here on leaves the group unusable (a rank may be waiting in a collective):
        it fails the engine, naming the rank at fault."""

        def send() -> object:
            for conn in self.conns:
                conn.send_bytes(b"s")
            blob = b"" if extra is None else pickle.dumps(extra)
            header, payload = wire.pack([len(blob), *values], self.device)
            extra_part = [torch.frombuffer(bytearray(blob), dtype=torch.uint8)] if blob else []
            for part in [header, payload, *extra_part]:
                part = part.to(self.device)
                if self.pp.size == 1:
                    dist.broadcast(part, 0)
                else:
                    for rank in range(1, self.size):
                        self.isend(part, rank, STEP_TAG)
            return forward()

        return self.call(send)

    def call(self, fn: Callable[[], object]):
        """Rank 0: `fn()`, a part of a step; its failure breaks the group, naming the rank at fault (`run`)."""
        if self.broken:
            raise EngineDeadError(self.broken)
        try:
            return fn()
        except Exception as e:
            self.broken = self._diagnose(e)
            raise EngineDeadError(self.broken) from e

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0, group=None) -> None:
        """Send `tensor` to rank `dst` (over `group`, default the whole one's) without waiting for it to be received.
        Each batch's sends were received once it returned, before a batch `batches_in_flight` later could start:
        waiting on those older than that many batches' sends (at most 3 a rank per batch) costs nothing, and drops
        what they kept."""
        while len(self.sends) >= 3 * self.size * self.pp.batches_in_flight:
            self.sends.popleft()[0].wait()
        self.sends.append((dist.isend(tensor, dst, group=group, tag=tag), tensor))

    @property
    def size(self) -> int:
        return self.pp.size * self.tp.size

    def command(self, command: "Command", local: Callable[[], None]) -> None:
        """Rank 0, between steps: every worker runs `command` (`answer`) while rank 0 runs `local()`; returns once all
        did. When every rank fails alike (each kept its state, `tiffin.engine.worker.sleep`), rank 0's error is
        raised; when only some fail, or a worker does not answer within START_TIMEOUT, the group is broken (its
        ranks may hold different weights)."""
        if self.broken:
            raise EngineDeadError(self.broken)
        for conn in self.conns:
            conn.send_bytes(b"c")
            conn.send(command)
        error = None
        try:
            local()
        except Exception as e:
            error = e
        failed = [self._answer(conn, rank) for rank, conn in enumerate(self.conns, 1)]
        if error is None and not any(failed):
            return
        if error is not None and all(failed):
            raise error
        named = "; ".join(f"rank {r}: {f}" for r, f in enumerate([error and str(error), *failed]) if f)
        self.broken = f"tensor-parallel ranks disagree after {command.name}: {named or 'rank 0 failed'}"
        raise EngineDeadError(self.broken) from error

    def _answer(self, conn, rank: int) -> str | None:
        """A worker's answer to a command: None if it succeeded, else why it failed."""
        try:
            if conn.poll(START_TIMEOUT):
                return conn.recv()
        except EOFError:
            pass
        return f"no answer: {self._diagnose(None)}"

    def answer(self, run: Callable[[], None]) -> None:
        """A worker: run a command's `run()`, then tell rank 0 whether it failed (`command`)."""
        try:
            run()
            failure = None
        except Exception as e:
            failure = f"{type(e).__name__}: {e}"
        self.conns[0].send(failure)

    def busy(self) -> list[float]:
        """Rank 0, between steps: every rank's `busy_s`, by rank (a benchmark's measure of each one's idle time)."""
        for conn in self.conns:
            conn.send_bytes(b"b")
        return [self.busy_s] + [conn.recv() for conn in self.conns]

    def receive(self) -> "tuple[list, object] | Command | None":
        """A worker: the next step's `(values, extra)` as rank 0 sent them, a `Command`, or None when told to
        stop; asked how busy it was (`busy`), it answers on the way."""
        while (bell := self.conns[0].recv_bytes()) == b"b":
            self.conns[0].send(self.busy_s)
        if bell == b"c":
            return self.conns[0].recv()
        if bell != b"s":
            return None
        layout = self._take(wire.HEADER_FIELDS * 3, torch.int64).view(-1, 3).tolist()
        extra_bytes, *values = wire.unpack(layout, self._take(wire.payload_size(layout), torch.int64))
        extra = pickle.loads(self._take(extra_bytes, torch.uint8).cpu().numpy().tobytes()) if extra_bytes else None
        return values, extra

    def _take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A worker: the next part of a step from rank 0 (`run`)."""
        part = torch.empty(numel, dtype=dtype, device=self.device)
        if self.pp.size > 1:
            dist.recv(part, 0, tag=STEP_TAG)
        else:
            dist.broadcast(part, 0)
        return part

    def shutdown(self) -> None:
        """End every worker (asked first, then terminated) and leave the process group: destroyed, or aborted when
        broken under NCCL (destroying waits on communicators that a peer dead mid-collective leaves hanging)."""
        self.stopping = True
        _stop(self.conns, self.procs, grace=0 if self.broken else 5)  # a hung worker would not answer anyway
        if dist.is_initialized():
            if self.broken and dist.get_backend() == "nccl":
                dist.distributed_c10d._abort_process_group()
            else:
                dist.destroy_process_group()
        if self.rank == 0:
            torch.set_num_threads(self.threads)

    def _diagnose(self, error: BaseException | None) -> str:
        deadline = time.monotonic() + DEATH_GRACE
        while not (dead := [f"rank {r} {death}" for r, p in enumerate(self.procs, 1) if (death := p.death())]):
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        cause = "" if error is None else f": {type(error).__name__}: {error}"
        if dead:
            return f"{self.kind} worker {', '.join(dead)}{cause}"
        ranks = ", ".join(str(r) for r in range(1, len(self.procs) + 1))
        return f"{self.kind} rank(s) {ranks} did not answer within distributed_timeout={self.timeout:g}s{cause}"


def spawn(
    config, threads: int, entry: Callable, args: tuple, rendezvous: Rendezvous | None = None
) -> tuple[list, list, Rendezvous]:
    """The `mp` executor: this node's ranks 1..N/nnodes-1 as spawned processes, each with a pipe to rank 0, meeting
    at `rendezvous` (default: a free port of 127.0.0.1; `multinode` for the other nodes' ranks)."""
    ctx, rendezvous = mp.get_context("spawn"), rendezvous or Rendezvous("127.0.0.1", free_port())
    conns, procs = [], []
    for rank in range(1, world_size(config) // config.nnodes):
        parent, child = ctx.Pipe()
        worker_args = (config, rank, rendezvous, child, threads, entry, args)
        proc = WorkerProcess(target=_worker, args=worker_args, name=f"tiffin-rank{rank}", daemon=True)
        proc.start()
        child.close()
        conns.append(parent)
        procs.append(proc)
    return conns, procs, rendezvous


def _watch(ref: weakref.ref) -> None:
    """Rank 0: a worker that exits while the engine idles marks the group broken at once, so that health checks
    report it before a request finds it."""
    group = ref()
    procs = group.procs
    del group  # the engine may be collected meanwhile; its finalizer ends the workers and so this wait
    type(procs[0]).wait_any(procs)
    del procs
    group = ref()
    if group is not None and not group.stopping and group.broken is None:
        group.broken = group._diagnose(None)


def _stop(conns: list, procs: list, grace: float = 5) -> None:
    for conn in conns:
        try:
            conn.send_bytes(b"x")
        except (OSError, ValueError):  # the worker is gone already
            pass
    for proc in procs:
        proc.join(grace)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    for conn in conns:
        conn.close()


def _worker(config, rank: int, rendezvous: Rendezvous, conn, threads: int, entry: Callable, args: tuple) -> None:
    """Rank `rank`'s process (or actor): join the group, then hand it to `entry`, which runs until told to stop."""
    torch.set_num_threads(threads)
    try:
        conn.send(("started",))
        tp, pp = init_group(config, rank, rendezvous)
        group = WorkerGroup(tp, rank_device(config.torch_device, rank), config.distributed_timeout, [conn], pp=pp)
        serve = entry(group, *args)
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        os._exit(1)
    try:
        serve()
    except EOFError:  # the engine process is gone
        os._exit(0)
    dist.destroy_process_group()
