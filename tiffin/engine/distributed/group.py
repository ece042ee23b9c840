"""Tensor parallelism: one model split across N ranks, one process per rank (vLLM's and nano-vllm's scheme).

Rank 0 is the engine's own process: it schedules, builds each step's flattened batch, broadcasts it, samples
and detokenizes. Ranks 1..N-1 are worker processes started here (`torch.multiprocessing` spawn); each builds a
`ModelRunner` of its rank (its shard of the weights, its share of the KV cache) and loops: wait for the
doorbell, receive the step's batch, run the forward. torch.distributed runs the collectives: NCCL on CUDA, gloo
on CPU, every one bounded by `distributed_timeout`.

A step's batch travels as two broadcasts: a fixed-size int64 header (the layout) and one int64 payload holding
every index tensor, whatever fields the attention metadata has. A per-worker pipe carries what must not wait
on a collective: the doorbell (so an idle engine never times a collective out), the KV block count agreed at
start, a worker's start-up error, and the stop; a worker whose engine process dies sees the pipe close and exits.
"""

import dataclasses
import datetime
import os
import socket
import threading
import weakref
from multiprocessing.connection import wait
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tiffin.engine.errors import EngineDeadError

HEADER_FIELDS = 24  # value slots in the step header: (kind, dim0, dim1) each
INT_KIND, LIST_KIND, NONE_KIND = 1, 2, 3
TENSOR_KINDS = {torch.int64: 4, torch.int32: 5}
START_TIMEOUT = 600.0  # seconds a worker may take to load its shard


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group; the default is a model served whole."""

    rank: int = 0
    size: int = 1

    def split(self, total: int, what: str) -> int:
        """This rank's share of `total` units of `what` (heads, vocabulary rows, ...); ValueError naming it."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size {self.size}")
        return total // self.size

    def kv_heads(self, total: int) -> int:
        """KV heads per rank: split, or replicated when there are fewer than ranks (MQA/GQA), so that each rank
        holds the KV heads its query heads read."""
        if total >= self.size:
            return self.split(total, "num_key_value_heads")
        if self.size % total:
            raise ValueError(f"tensor_parallel_size {self.size} is not a multiple of num_key_value_heads ({total})")
        return 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `x` concatenated along the last dim, on rank 0; None on the others."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x.contiguous(), parts, dst=0)
        return torch.cat(parts, dim=-1) if self.rank == 0 else None


WHOLE = TensorParallel()  # no tensor parallelism: one rank holds the whole model


class Step(NamedTuple):
    """One step's batch, as `ModelRunner._prepare` builds it."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    md: object  # kernels.AttentionMetadata
    logits_indices: torch.Tensor


class Parallel:
    """The group's collectives and, on rank 0, its worker processes."""

    def __init__(self, tp: TensorParallel, device: torch.device, timeout: float, conns: list, procs: list = ()):
        self.tp, self.device, self.timeout = tp, device, timeout
        self.conns, self.procs = conns, list(procs)  # rank 0: one per worker; a worker: its pipe to rank 0
        self.broken: str | None = None  # rank 0: why the group cannot run another step
        self.stopping = False

    @classmethod
    def start(cls, config, model_config, max_model_len: int, device: torch.device) -> "Parallel":
        """Rank 0: spawn ranks 1..N-1 (each loads its shard meanwhile) and join the process group."""
        size = config.tensor_parallel_size
        _check_splits(model_config, TensorParallel(0, size))
        if device.type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs, {torch.cuda.device_count()} are visible")
        if dist.is_initialized():
            raise RuntimeError("a tensor-parallel engine already runs in this process; shut it down first")
        port, threads = _free_port(), torch.get_num_threads()
        if device.type == "cpu":  # the ranks share the CPUs: one thread each on as many cores as there are
            torch.set_num_threads(max(1, threads // size))
        ctx = mp.get_context("spawn")
        conns, procs = [], []
        for rank in range(1, size):
            parent, child = ctx.Pipe()
            args = (config, model_config, max_model_len, rank, port, child, torch.get_num_threads())
            proc = ctx.Process(target=_worker, args=args, name=f"tiffin-tp{rank}", daemon=True)
            proc.start()
            child.close()
            conns.append(parent)
            procs.append(proc)
        self = cls(TensorParallel(0, size), device, config.distributed_timeout, conns, procs)
        self.threads = threads  # given back at shutdown
        weakref.finalize(self, _stop, conns, procs)  # no orphan workers, even if the engine is never shut down
        threading.Thread(target=_watch, args=(weakref.ref(self),), name="tiffin-tp-watch", daemon=True).start()
        try:
            for rank, conn in enumerate(conns, 1):  # imports done: the group forms within distributed_timeout
                self._receive(conn, rank)
            _init_group(config, 0, port)
        except Exception as e:
            # torch counts default groups from the start of a join: a failed one would leave this process's
            # count ahead of the next engine's fresh workers, whose joins would then never meet it
            dist.distributed_c10d._world.group_count = 0
            self.shutdown()
            if isinstance(e, (EngineDeadError, ValueError)):
                raise
            raise EngineDeadError(self._diagnose(e)) from e
        return self

    def agree_num_blocks(self, num_blocks: int) -> int:
        """The KV block count every rank can hold (the smallest); on rank 0, a worker's start-up error raised."""
        if self.tp.rank:
            self.conns[0].send(("ready", num_blocks))
            return self.conns[0].recv()
        counts = [num_blocks] + [self._receive(conn, rank)[1] for rank, conn in enumerate(self.conns, 1)]
        for conn in self.conns:
            conn.send(min(counts))
        return min(counts)

    def _receive(self, conn, rank: int) -> tuple:
        """A starting worker's next message; its start-up error (or death, or silence) raised, workers ended."""
        if not conn.poll(START_TIMEOUT):
            self.shutdown()
            raise EngineDeadError(f"tensor-parallel rank {rank} did not start within {START_TIMEOUT:.0f}s")
        try:
            reply = conn.recv()
        except EOFError:
            self.shutdown()
            raise EngineDeadError(f"tensor-parallel rank {rank} died while starting") from None
        if reply[0] == "error":
            self.shutdown()
            raise ValueError(f"tensor-parallel rank {rank}: {reply[1]}")
        return reply

    def run(self, step: Step, lora_slots, forward):
        """Rank 0: send `step` and run `forward(step)`. A failure from here on leaves the group unusable (a rank
        may be waiting in a collective): it fails the engine, naming the rank at fault."""
        if self.broken:
            raise EngineDeadError(self.broken)
        try:
            self.broadcast_step(step, lora_slots)
            return forward(step)
        except Exception as e:
            self.broken = self._diagnose(e)
            raise EngineDeadError(self.broken) from e

    def broadcast_step(self, step: Step | None, lora_slots) -> Step | None:
        """Rank 0 sends `step` and the adapters it installed this step; a worker installs those into its own
        slots and returns the step, or None when told to stop."""
        if self.tp.rank == 0:
            for conn in self.conns:
                conn.send_bytes(b"s")
            installs = [] if lora_slots is None else lora_slots.take_installs()
            lora = None if lora_slots is None or lora_slots.token_slots is None else lora_slots.token_slots
            md = [getattr(step.md, f.name) for f in dataclasses.fields(step.md)]
            header, payload = _pack(
                [step.input_ids, step.positions, step.logits_indices, lora, len(installs), *md], self.device
            )
            dist.broadcast(header, 0)
            dist.broadcast(payload, 0)
            if installs:
                dist.broadcast_object_list([installs], 0, device=self.device)
            return step
        if self.conns[0].recv_bytes() != b"s":
            return None
        header = torch.empty(HEADER_FIELDS * 3, dtype=torch.int64, device=self.device)
        dist.broadcast(header, 0)
        layout = header.view(-1, 3).tolist()
        payload = torch.empty(sum(_numel(*v) for v in layout), dtype=torch.int64, device=self.device)
        dist.broadcast(payload, 0)
        values = _unpack(layout, payload)
        installs = [None]
        if values[4]:
            dist.broadcast_object_list(installs, 0, device=self.device)
        if lora_slots is not None:
            lora_slots.follow(installs[0] or [], values[3])
        from tiffin.kernels import AttentionMetadata

        return Step(values[0], values[1], AttentionMetadata(*values[5:]), values[2])

    def shutdown(self) -> None:
        """End every worker (asked first, then terminated) and leave the process group."""
        self.stopping = True
        _stop(self.conns, self.procs, grace=0 if self.broken else 5)  # a hung worker would not answer anyway
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.tp.rank == 0:
            torch.set_num_threads(self.threads)

    def _diagnose(self, error: BaseException | None) -> str:
        for proc in self.procs:  # a peer that closed the connection may still be exiting
            proc.join(1)
        dead = [
            f"rank {r} died (exit code {p.exitcode})" for r, p in enumerate(self.procs, 1) if p.exitcode is not None
        ]
        cause = "" if error is None else f": {type(error).__name__}: {error}"
        if dead:
            return f"tensor-parallel worker {', '.join(dead)}{cause}"
        ranks = ", ".join(str(r) for r in range(1, self.tp.size))
        return f"tensor-parallel rank(s) {ranks} did not answer within distributed_timeout={self.timeout:g}s{cause}"


def _pack(values: list, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The header, (kind, dim0, dim1) per value (dim1 -1 for a 1-D tensor), and the int64 payload holding every
    list and tensor among `values`."""
    header, parts = [], []
    for v in values:
        if v is None:
            header.append((NONE_KIND, 0, 0))
        elif isinstance(v, int):
            header.append((INT_KIND, v, 0))
        elif isinstance(v, list):
            header.append((LIST_KIND, len(v), 0))
            parts.append(torch.tensor(v, dtype=torch.int64))
        else:
            header.append((TENSOR_KINDS[v.dtype], v.shape[0], v.shape[1] if v.dim() == 2 else -1))
            parts.append(v.reshape(-1).to(torch.int64))
    if len(header) > HEADER_FIELDS:
        raise ValueError(f"a step has {len(header)} fields, the header holds {HEADER_FIELDS}")
    header += [(0, 0, 0)] * (HEADER_FIELDS - len(header))
    payload = torch.cat([p.to(device) for p in parts])
    return torch.tensor(header, dtype=torch.int64, device=device), payload


def _numel(kind: int, d0: int, d1: int) -> int:
    if kind == LIST_KIND:
        return d0
    return d0 * max(d1, 1) if kind in TENSOR_KINDS.values() else 0


def _unpack(layout: list, payload: torch.Tensor) -> list:
    dtypes = {kind: dtype for dtype, kind in TENSOR_KINDS.items()}
    host = payload.cpu()  # the lists are host-side values: one copy for all of them
    values, offset = [], 0
    for kind, d0, d1 in layout:
        n = _numel(kind, d0, d1)
        if kind == INT_KIND:
            values.append(d0)
        elif kind == LIST_KIND:
            values.append(host[offset : offset + n].tolist())
        elif kind == NONE_KIND:
            values.append(None)
        elif kind:
            values.append(payload[offset : offset + n].view((d0, d1) if d1 >= 0 else (d0,)).to(dtypes[kind]))
        offset += n
    return values


def _check_splits(model_config, tp: TensorParallel) -> None:
    """Refuse a model the ranks cannot share, by name, before any worker starts (the layers check again)."""
    tp.split(model_config.num_heads, "num_attention_heads")
    tp.kv_heads(model_config.num_kv_heads)
    tp.split(model_config.intermediate_size, "intermediate_size")
    tp.split(model_config.vocab_size, "vocab_size")


def _init_group(config, rank: int, port: int) -> None:
    device = config.torch_device
    if device.type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=config.tensor_parallel_size,
        timeout=datetime.timedelta(seconds=config.distributed_timeout),
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _watch(ref: weakref.ref) -> None:
    """Rank 0: a worker that exits while the engine idles marks the group broken at once, so that health checks
    report it before a request finds it."""
    parallel = ref()
    sentinels = [proc.sentinel for proc in parallel.procs]
    del parallel  # the engine may be collected meanwhile; its finalizer ends the workers and so this wait
    wait(sentinels)
    parallel = ref()
    if parallel is not None and not parallel.stopping and parallel.broken is None:
        parallel.broken = parallel._diagnose(None)


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


def _worker(config, model_config, max_model_len: int, rank: int, port: int, conn, threads: int) -> None:
    """Rank `rank`'s process: load the shard, then run forwards until told to stop or the engine is gone."""
    torch.set_num_threads(threads)
    try:
        from tiffin.engine.model_runner import ModelRunner

        conn.send(("started",))
        _init_group(config, rank, port)
        device = torch.device("cuda", rank) if config.torch_device.type == "cuda" else config.torch_device
        parallel = Parallel(
            TensorParallel(rank, config.tensor_parallel_size), device, config.distributed_timeout, [conn]
        )
        runner = ModelRunner(config, model_config, max_model_len, set(), parallel)
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        os._exit(1)
    try:
        while (step := parallel.broadcast_step(None, runner.lora_slots)) is not None:
            runner.run_model(step)
    except EOFError:  # the engine process is gone
        os._exit(0)
    dist.destroy_process_group()
