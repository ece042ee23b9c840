"""A data-parallel replica's process (tiffin.engine.data_parallel): its own `LLMEngine`, serving the front's
messages over a pipe and stepping while it has work.

Messages from the front: ("add", request_id, prompt, params, lora, client, answered), ("abort", request_id),
("call", method, args), ("stop",). To the front: ("ready", info) or ("error", why) once; ("step", outputs, KV
events, adapters newly seen, stats, queue, adapters cached) whenever one of them changed; ("result", (ok, value))
for a call, or an add sent `answered` (its refusal then raised at the front, not a failed output); ("dead", why)
when the engine cannot step. A report that precedes a result holds everything the replica did before it."""

import functools
import operator
from collections import Counter
from dataclasses import dataclass

import torch

from tiffin.engine.config import EngineConfig
from tiffin.engine.kv_events import KVEventPublisher
from tiffin.engine.llm_engine import LLMEngine
from tiffin.engine.outputs import RequestOutput

# what the front takes from replica 0 to check requests as the replicas will (InputProcessor's attributes)
FRONT_ATTRS = (
    "config",
    "model_config",
    "max_model_len",
    "max_prompt_chars",
    "max_token_chars",
    "image_limits",
    "task",
    "pooling_task",
    "supported_tasks",
    "eos_token_ids",
    "reasoning",
    "think_end_ids",
)


def _error(e: Exception) -> tuple:
    return type(e).__name__, str(e), getattr(e, "param", None)


def replica_main(config: EngineConfig, rank: int, conn, threads: int, endpoint: str | None, topic: str) -> None:
    """Replica `rank`'s process: build its engine, then serve the front's messages and step while it has work,
    reporting each step's outputs, KV events, newly seen adapters and stats."""
    torch.set_num_threads(threads)
    try:
        engine = LLMEngine(config)
        engine.block_manager.events = []
        publisher = None if endpoint is None else KVEventPublisher(endpoint, topic, rank)
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    info = {name: getattr(engine, name) for name in FRONT_ATTRS}
    ready = {"num_blocks": engine.block_manager.num_blocks, "stats": engine.stats()}
    conn.send(("ready", info | ready | {"lora": engine.lora_registry is not None}))
    loras: dict[int, bytes] = {}
    reported = _Reported()
    report = functools.partial(_report, engine, conn, publisher, loras, reported)
    try:
        while True:
            outputs = []
            busy = engine.has_unfinished_requests()
            while (not busy and not outputs) or conn.poll():
                message = conn.recv()
                if message[0] == "stop":
                    return
                if message[0] == "add":
                    reported.taken += getattr(message[3], "n", 1)
                if message[0] == "call" or message[0] == "add" and message[-1]:  # the front waits for the answer
                    answer = _answer(engine, *message[1:]) if message[0] == "call" else _add(engine, message, loras)
                    report(outputs)  # the outputs before it and the events of it reach the front first
                    outputs = []
                    conn.send(("result", answer))
                else:
                    outputs += _handle(engine, message, loras)
                busy = engine.has_unfinished_requests()
            if engine.has_unfinished_requests():
                outputs += engine.step()
            report(outputs)
    except EOFError:  # the front is gone
        return
    except Exception as e:  # the engine cannot step
        conn.send(("dead", f"data-parallel replica {rank} failed: {type(e).__name__}: {e}"))
    finally:
        engine.shutdown()
        if publisher is not None:
            publisher.close()


def _handle(engine: LLMEngine, message: tuple, loras: dict[int, bytes]) -> list[RequestOutput]:
    """An abort, or an add nobody waits for: a refusal becomes the request's failed output."""
    if message[0] == "abort":
        return engine.abort_request(message[1])
    ok, refusal = _add(engine, message, loras)
    if ok:
        return []
    request_id, prompt = message[1:3]
    return [RequestOutput(request_id, prompt.text, prompt.token_ids, finished=True, error=": ".join(refusal[:2]))]


def _add(engine: LLMEngine, message: tuple, loras: dict[int, bytes]) -> tuple:
    """Add a request (its adapter's identity noted for the front's router): an answer as `_answer`'s."""
    _, request_id, prompt, params, lora, client, _ = message
    try:
        engine.add_request(request_id, prompt, params, lora, client)
    except Exception as e:
        return False, _error(e)
    adapter = engine.requests[request_id].seqs[0].lora
    if adapter is not None:
        loras[adapter.int_id] = adapter.identity
    return True, None


def _answer(engine: LLMEngine, method: str, args: tuple) -> tuple:
    """`method`: a method of the engine or of one of its parts ("block_manager.cached.copy")."""
    try:
        return True, operator.attrgetter(method)(engine)(*args)
    except Exception as e:
        return False, _error(e)


@dataclass
class _Reported:
    """A replica's own record for its reports."""

    taken: int = 0  # sequences added (or refused) in all
    reported: int = -1  # `taken` as last reported
    cached: frozenset = frozenset()  # the adapters in its host cache, as last reported


def _report(engine: LLMEngine, conn, publisher, loras: dict, last: _Reported, outputs: list) -> None:
    """Send what changed: outputs, KV events, adapters newly seen, the queue (the sequences taken in all, those
    waiting by client) or the adapters cached, with the stats."""
    events = engine.block_manager.take_events()
    if publisher is not None:
        publisher.publish(events)
    cached = frozenset() if engine.lora_registry is None else frozenset(engine.list_loras())
    if outputs or events or loras or last.taken != last.reported or cached != last.cached:
        queue = last.taken, Counter(seq.client for seq in engine.scheduler.waiting)
        conn.send(("step", outputs, events, dict(loras), engine.stats(), queue, cached))
        loras.clear()
        last.reported, last.cached = last.taken, cached
