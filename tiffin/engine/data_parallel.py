"""Data parallelism on one host: `data_parallel_size` engine replicas, each an `LLMEngine` in a process of its own
(with its own tensor/pipeline-parallel group, KV pool and threads), behind one front object that takes the place of
an `LLMEngine` for `LLM` and `AsyncLLMEngine`.

The front tokenizes and checks each request (`InputProcessor`, the replicas' limits), lets the `Router` pick a
replica by the load the request would see on each (tiffin.engine.replica_work: under priorities or fair share, the
work it could not overtake there; each replica's scheduler then applies both), sends the request there and streams
that replica's outputs back; `step()` returns whatever outputs the replicas reported since the last call (each
replica steps on its own, continuously). An abort goes to the replica holding the request; its final output comes
back with a later `step()`. Each replica reports, with its outputs, the KV events of its block pool
(tiffin.engine.kv_events), which keep the router's map of its blocks, and publishes them on its own ZMQ socket when
`kv_events_endpoint` is set (the port moved up by its rank).

Invariants: a request lives in exactly one replica from `add_request` until its finished output has come back;
a replica's load is the tokens (prompt and outputs so far, each of its n samples) of its requests in flight, as the
front last saw them. A replica that dies fails its requests in flight (naming it) and receives no more; the others
go on. The front keeps the replicas' waiting queues (max_waiting_requests and max_waiting_per_client per replica,
tiffin.engine.replica_admin): a request goes to a replica with room, QueueFull when none has, so that it is refused
as one engine refuses it. An adapter a server adds is read by one replica (`add_lora`) and named in the front's
`lora_registry`; any other replica reads it when the router first sends it one of its requests (LoRA affinity keeps
them on the replicas holding it, within the balance threshold). Each replica's process:
tiffin.engine.data_parallel_replica; a replica that dies is started again (tiffin.engine.replica_supervisor) and
taken in empty: no blocks in the router's map, no adapter, nothing in flight. With `data_parallel_backend="ray"`
the replicas are actors of a Ray cluster, across its nodes (tiffin.engine.ray_replicas), driven alike."""

import dataclasses
import functools
import queue
import threading
import weakref
from copy import deepcopy
from dataclasses import dataclass
from multiprocessing.connection import wait

import torch
import torch.multiprocessing as mp

from tiffin.engine import errors
from tiffin.engine.config import EngineConfig
from tiffin.engine.data_parallel_replica import FRONT_ATTRS, replica_main
from tiffin.engine.distributed.join import world_size
from tiffin.engine.errors import EngineAsleep, EngineDeadError
from tiffin.engine.input_processor import InputProcessor, PromptType
from tiffin.engine.llm_engine import LLMEngine
from tiffin.engine.lora.request import LoRARequest
from tiffin.engine.models.source import load_tokenizer
from tiffin.engine.outputs import EngineStats, PoolingRequestOutput, RequestOutput
from tiffin.engine.pooling_params import PoolingParams
from tiffin.engine.replica_admin import AdapterTable, QueueRoom, health
from tiffin.engine.replica_supervisor import Supervisor, exit_cause
from tiffin.engine.replica_work import Group, ReplicaWork
from tiffin.engine.router import Router
from tiffin.engine.sampling_params import SamplingParams

STEP_WAIT = 0.01  # seconds `step()` waits for a replica's report: adds and aborts between are seen this late


@dataclass
class _Capacity:
    """The KV pool size of one replica, which `InputProcessor` checks a request against."""

    num_blocks: int
    block_size: int


@dataclass
class _Routed:
    replica: int
    tokens: int  # its load on the replica
    hashes: list[bytes]  # its prompt's blocks, as the router hashed them
    group: Group  # how the replica's scheduler orders it (client, priority), and whether it started
    seqs: int


def make_engine(config: EngineConfig) -> "LLMEngine | DataParallelEngine":
    """An `LLMEngine`, or the front of `data_parallel_size` of them; of one when it publishes KV events (only a
    replica's process publishes them)."""
    if config.data_parallel_size == 1 and config.kv_events_endpoint is None:
        return LLMEngine(config)
    return DataParallelEngine(config)


class DataParallelEngine(InputProcessor):
    grammars = LLMEngine.grammars  # AsyncLLMEngine compiles a grammar before it sends its request: then cached

    def __init__(self, config: EngineConfig):
        n = config.data_parallel_size
        threads = max(1, torch.get_num_threads() // n) if config.torch_device.type == "cpu" else 1
        self.replicas = Supervisor(_starter(config, threads), n, config.data_parallel_max_restarts)
        self.conns, self.procs = self.replicas.conns, self.replicas.procs  # replica r's current pipe and process
        # stops the replicas when this object is collected or the interpreter exits (before it joins non-daemons)
        self._stop = weakref.finalize(self, self.replicas.close)
        self.dead: list[str | None] = [None] * n  # why each replica stopped (until a replacement is taken in)
        infos = self.replicas.started()
        for name in FRONT_ATTRS:
            setattr(self, name, infos[0][name])
        queue_limits = {name: getattr(config, name) for name in ("max_waiting_requests", "max_waiting_per_client")}
        # the front's own settings, not the replicas'
        front = dict(data_parallel_size=n, kv_events_endpoint=config.kv_events_endpoint, **queue_limits)
        self.config = dataclasses.replace(self.config, **front)
        self.block_manager = _Capacity(infos[0]["num_blocks"], config.block_size)
        # adapters are read by the replicas (`load_lora` hands the request on); this table names those added
        self.lora_registry = AdapterTable() if infos[0]["lora"] else None
        self.replica_loras = [frozenset()] * n  # the adapters in each replica's host cache, as last reported
        self.queue = QueueRoom.of(n, *queue_limits.values())
        self.tokenizer = load_tokenizer(self.config.tokenizer or self.config.model)
        self._chat_tokenizers = queue.SimpleQueue()
        self._chat_tokenizers.put(deepcopy(self.tokenizer))
        self._grammar_backend, self._grammar_backend_lock = None, threading.Lock()
        self.router = Router(n, config.block_size, config.router_policy, config.router_balance_threshold)
        self.requests: dict[str, _Routed] = {}
        by_priority = config.scheduling_policy == "priority"
        self.work = ReplicaWork(n, by_priority, config.fair_share, config.max_num_seqs)
        self.replica_stats = [info["stats"] for info in infos]
        self.sleep_level = 0
        self._lora_keys: dict[int, bytes] = {}  # lora_int_id -> identity, as the replicas resolved it
        self._pending: list[RequestOutput] = []  # outputs received while waiting for a call's answer

    # --- requests ---

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
        client: str | None = None,
    ) -> None:
        """Check the request as a replica would (raising as `LLMEngine.add_request` does), route it to a replica
        with room in its queue (QueueFull when none has) and send it. With an adapter that replica had not cached
        (as it last reported), wait for it to take the request: a refusal (the adapter cannot be read) is raised
        here as the replica raised it. Only an adapter evicted from its cache since its report, and unreadable
        by then, still fails as the request's output."""
        self.check_awake()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        prompt, params, _ = self.check_request(prompt, params)
        n = getattr(params, "n", 1)
        self.queue.check(n, client)
        self._reap()
        self._adopt()
        full = [self.dead[r] is None and self.queue.full(r, n, client) for r in range(len(self.conns))]
        if any(full) and all(why is not None or full[r] for r, why in enumerate(self.dead)):
            self.queue.refuse([why for why in full if why])
        lora_id = None if lora_request is None else lora_request.lora_int_id
        key = b"" if lora_id is None else self._lora_keys.get(lora_id)
        hashes = [] if key is None else self.router.prompt_hashes(prompt.token_ids, key, prompt.images)
        priority = getattr(params, "priority", 0)
        usable = [dead is None and not no_room for dead, no_room in zip(self.dead, full)]
        tokens = len(prompt.token_ids) * n
        loads = self.work.view(client, priority, tokens, usable)
        replica = self.router.route(hashes, loads, lora_id, self.loads)
        if self.dead[replica] is not None:
            raise EngineDeadError(f"no data-parallel replica serves: {'; '.join(self._why_dead())}")
        # an adapter the replica does not hold is read there now: wait for its answer, to raise a refusal here
        cold = lora_id is not None and lora_id not in self.replica_loras[replica]
        message = ("add", request_id, prompt, params, lora_request, client, cold)
        self.queue.sent[replica] += n
        if not cold:
            self.conns[replica].send(message)
        else:
            try:
                self._ask(replica, message)
            except Exception:
                if self.dead[replica] is None:
                    self.router.finished(replica, hashes)
                raise
        routed = self.requests[request_id] = _Routed(replica, tokens, hashes, (client, priority, False), n)
        self.work.add(replica, routed.group, tokens, n)

    @property
    def loads(self) -> list[int]:
        """Each replica's load: the tokens of its requests in flight (any thread)."""
        return self.work.totals

    def _reap(self) -> None:
        """Take in what each replica whose process exited (its pipe not yet read to the end) left, failing its
        requests in flight: the router sends it nothing more."""
        for rank, proc in enumerate(self.procs):
            while self.dead[rank] is None and not proc.is_alive():
                self._pending += self._apply(rank, self._receive(rank))

    def _adopt(self) -> None:
        """Take in each replica started again since (tiffin.engine.replica_supervisor), after what its dead process
        left: it starts empty (no blocks, no load, no queue, no adapter: the router sends an adapter's requests to
        the replicas holding it, and this one reads it when one comes)."""
        for rank in list(self.replicas.ready):
            while self.dead[rank] is None:  # its death not yet read from the pipe: fail its requests first
                self._pending += self._apply(rank, self._receive(rank))
            self.replica_stats[rank] = self.replicas.ready[rank].info["stats"]
            self.replica_loras[rank] = frozenset()
            self.queue.forget(rank)
            self.dead[rank] = None  # before the swap: other threads see it ready (in `ready`) or serving
            self.replicas.adopt(rank)

    def step(self) -> list[RequestOutput]:
        """The outputs the replicas reported since the last call, waiting up to STEP_WAIT for one."""
        self._adopt()
        outputs, self._pending = self._pending, []
        live = [conn for conn, dead in zip(self.conns, self.dead) if dead is None]
        for conn in wait(live, 0 if outputs else STEP_WAIT):
            rank = self.conns.index(conn)
            while self.dead[rank] is None and conn.poll():
                outputs += self._apply(rank, self._receive(rank))
        return outputs

    def _receive(self, rank: int) -> tuple:
        """Replica `rank`'s next message; ("dead", why) when it is gone."""
        try:
            return self.conns[rank].recv()
        except (EOFError, OSError):
            self.procs[rank].join(1)
            return "dead", f"data-parallel replica {rank} died ({exit_cause(self.procs[rank])})"

    def _apply(self, rank: int, message: tuple) -> list[RequestOutput]:
        """Take in a replica's report: its KV events into the router, its outputs into the loads."""
        if message[0] == "dead":
            return self._replica_died(rank, message[1])
        if message[0] == "result":
            raise RuntimeError(f"data-parallel replica {rank} answered a call nobody made")
        _, outputs, events, loras, stats, queue, self.replica_loras[rank] = message
        self.router.apply_events(rank, events)
        self.queue.reported(rank, queue)
        self._lora_keys.update(loras)
        self.replica_stats[rank] = stats
        for out in outputs:
            self._account(out)
        return outputs

    def _account(self, out: RequestOutput | PoolingRequestOutput) -> None:
        """Follow a request's load on its replica (a pooling request's one output is its finished one)."""
        routed = self.requests.get(out.request_id)
        if routed is None:
            return
        self.work.add(routed.replica, routed.group, -routed.tokens, -routed.seqs)
        if out.finished:
            self.router.finished(routed.replica, routed.hashes)
            del self.requests[out.request_id]
            return
        routed.tokens = sum(len(out.prompt_token_ids) + len(o.token_ids) for o in out.outputs)
        routed.group = (*routed.group[:2], True)  # its first output: it runs
        self.work.add(routed.replica, routed.group, routed.tokens, routed.seqs)

    def _replica_died(self, rank: int, why: str) -> list[RequestOutput]:
        """Fail `rank`'s requests in flight, naming it; the router sends it nothing more and forgets its blocks."""
        self.dead[rank] = why
        lost = [rid for rid, routed in self.requests.items() if routed.replica == rank]
        for rid in lost:
            del self.requests[rid]
        self.work.clear(rank)
        self.router.forget(rank)
        return [RequestOutput(rid, None, [], finished=True, error=why) for rid in lost]

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Send each abort to the request's replica (unknown ids are ignored); the final outputs come with a later
        `step()`, once the replica freed the blocks."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            routed = self.requests.get(rid)
            if routed is not None and self.dead[routed.replica] is None:
                self.conns[routed.replica].send(("abort", rid))
        return []

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self._pending)

    def failure(self) -> str | None:
        """Why the engine cannot serve: every replica is dead and none will be started again (any thread)."""
        why = self._why_dead()
        return None if not all(why) or any(map(self.replicas.will_serve, range(len(why)))) else "; ".join(why)

    def serving(self) -> bool:
        """Whether some replica serves now (any thread): while every one is being restarted, not (not ready)."""
        return not all(self._why_dead())

    def _why_dead(self) -> list[str | None]:
        """Why each replica stopped (None: it serves, or its replacement is ready), its process seen exited before
        its pipe says so, with what becomes of it."""
        whys = []
        for r, (why, proc) in enumerate(zip(self.dead, self.procs)):
            if r in self.replicas.ready:
                why = None
            elif why is None and not proc.is_alive():
                why = f"data-parallel replica {r} died ({exit_cause(proc)})"
            whys.append(None if why is None else why + self.replicas.note(r))
        return whys

    def replica_health(self) -> list[dict]:
        """Each replica's `replica_admin.health` (any thread)."""
        ranks, nodes = range(len(self.procs)), [getattr(proc, "address", None) for proc in self.procs]
        return list(map(health, ranks, self._why_dead(), self.replica_stats, self.loads, self.replicas.restarts, nodes))

    def stats(self) -> EngineStats:
        """The live replicas' stats summed (as of their last reports); kv_bytes_per_token is one replica's."""
        stats = [s for s, dead in zip(self.replica_stats, self.dead) if dead is None] or self.replica_stats
        per_pos = tuple(map(sum, zip(*(s.spec_accepted_per_pos for s in stats))))
        fields = [f.name for f in dataclasses.fields(EngineStats) if f.name != "spec_accepted_per_pos"]
        summed = {name: sum(getattr(s, name) for s in stats) for name in fields} | {"spec_accepted_per_pos": per_pos}
        summed["kv_bytes_per_token"] = stats[0].kv_bytes_per_token
        return EngineStats(**summed)

    # --- calls on every replica ---

    def _call(self, rank: int, method: str, *args):
        """`method(*args)` on replica `rank`'s engine, between its steps; what it raises is raised here."""
        self._adopt()
        return self._ask(rank, ("call", method, args))

    def _ask(self, rank: int, message: tuple):
        """Send replica `rank` a message it answers (a call, an add waited for) and return the answer. Reports
        that arrive first are taken in, their outputs kept for the next `step()`."""
        if self.dead[rank] is not None:
            raise EngineDeadError(self.dead[rank])
        self.conns[rank].send(message)
        while (message := self._receive(rank))[0] != "result":
            self._pending += self._apply(rank, message)
            if message[0] == "dead":
                raise EngineDeadError(message[1])
        return _unwrap(message[1])

    def _call_all(self, method: str, *args) -> list:
        self._adopt()  # a replica started again gets the call too
        return [self._call(rank, method, *args) for rank in range(len(self.conns)) if self.dead[rank] is None]

    def load_lora(self, lora_request: LoRARequest) -> LoRARequest:
        return lora_request  # each replica reads it where it is served

    def add_lora(self, lora: LoRARequest) -> bool:
        """Add the adapter on one live replica (which reads it: its refusal is raised as it raised it), and name
        it in `lora_registry`; the router sends its requests there, and to another replica (which reads it then)
        only past the balance threshold. The replica: one that holds it already, else the one holding the fewest
        adapters, then the least loaded. False if that replica had it cached."""
        self._adopt()
        held = lambda r: (lora.lora_int_id not in self.replica_loras[r], len(self.replica_loras[r]), self.loads[r], r)
        rank = min((r for r, why in enumerate(self.dead) if why is None), key=held, default=None)
        if rank is None:
            raise EngineDeadError(f"no data-parallel replica serves: {'; '.join(self._why_dead())}")
        cached = self._call(rank, "add_lora", lora)
        self.router.lora_replicas.setdefault(lora.lora_int_id, set()).add(rank)
        if self.lora_registry is not None:
            self.lora_registry.add(lora)
        return cached

    def remove_lora(self, lora_int_id: int) -> bool:
        self.router.lora_replicas.pop(lora_int_id, None)
        self._lora_keys.pop(lora_int_id, None)
        if self.lora_registry is not None:
            self.lora_registry.remove(lora_int_id)
        return any(self._call_all("remove_lora", lora_int_id))

    def list_loras(self) -> set[int]:
        return set().union(*self._call_all("list_loras"))

    def reset_prefix_cache(self) -> bool:
        """Each replica's `reset_prefix_cache` (False: some replica's sequences hold blocks)."""
        return all(self._call_all("reset_prefix_cache"))

    def sleep(self, level: int = 1) -> None:
        self._call_all("sleep", level)
        self.sleep_level = max(self.sleep_level, level)

    def wake_up(self) -> None:
        self._call_all("wake_up")
        self.sleep_level = 0

    def is_sleeping(self) -> bool:
        return self.sleep_level > 0

    def check_awake(self) -> None:
        if self.sleep_level:
            raise EngineAsleep(f"the engine is asleep (sleep level {self.sleep_level}): wake_up first")

    def check_checkpoint(self, path: str) -> dict:
        return self._call(0, "check_checkpoint", path)

    def update_weights(self, path: str, abort_in_flight: bool = False) -> None:
        if abort_in_flight:  # through the front, so that their final outputs come back (before the call's answer)
            self.abort_request(list(self.requests))
        self._call_all("update_weights", path, abort_in_flight)

    def shutdown(self) -> None:
        """Stop every replica (also done when this object is collected, or at exit)."""
        self._stop()


def _starter(config: EngineConfig, threads: int):
    """What starts replica `rank` (`start(rank)`: its pipe and process, or its Ray actor)."""
    if config.data_parallel_backend == "ray":
        from tiffin.engine.ray_replicas import RayReplicas  # Ray is an optional dependency

        return RayReplicas(config, threads, _replica_config)
    return functools.partial(_start, config, threads)


def _start(config: EngineConfig, threads: int, rank: int) -> tuple:
    """Start replica `rank`'s process (`threads` torch threads): the front's end of its pipe, and the process."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    args = (_replica_config(config, rank), rank, child, threads, config.kv_events_endpoint, config.kv_events_topic)
    daemon = world_size(config) == 1  # a replica with tensor/pipeline ranks starts processes of its own
    proc = ctx.Process(target=replica_main, args=args, name=f"tiffin-dp{rank}", daemon=daemon)
    proc.start()
    child.close()
    return parent, proc


def _replica_config(config: EngineConfig, rank: int) -> EngineConfig:
    """Replica `rank`'s engine settings: one replica, publishing no events itself (its process does), refusing
    no request for its queue (the front does, `QueueRoom`), and on CUDA
    the GPUs after those of the replicas before it."""
    replica = dataclasses.replace(
        config, data_parallel_size=1, kv_events_endpoint=None, max_waiting_requests=None, max_waiting_per_client=None
    )
    device = config.torch_device
    if device.type == "cuda":
        replica.device = f"cuda:{(device.index or 0) + rank * world_size(config)}"
    return replica


def _unwrap(result: tuple):
    """A call's answer: its value, or its exception raised again as its class (ValueError where not one of ours)."""
    ok, value = result
    if ok:
        return value
    name, message, param = value
    cls = getattr(errors, name, None)
    if cls is errors.ParamError:
        raise cls(param, message)
    raise (cls if isinstance(cls, type) and issubclass(cls, Exception) else ValueError)(message)
