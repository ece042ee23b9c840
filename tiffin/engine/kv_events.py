"""KV-cache events in vLLM's format, so that outside routers (llm-d, Dynamo) can follow which blocks an engine holds:
the block pool records them (`BlockManager.events`), a `KVEventPublisher` sends them, and tiffin's own router
(tiffin.engine.router) reads the same events.

The format (vLLM's `vllm.distributed.kv_events`): msgpack of array-like msgspec structs; an event is a tagged array
`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]`,
`["BlockRemoved", block_hashes, medium]` or `["AllBlocksCleared"]`, and a batch `[ts, events]`, with a third item,
the data-parallel rank, for a replica of a data-parallel engine. Sent on a ZMQ PUB socket as three frames: topic,
an 8-byte big-endian sequence number (from 0, one per batch), the payload.

Block hashes are the engine's own (32-byte sha256 chain, `block_manager.hash_block`), sent as bytes; `medium` is
None (the engine's KV pool: blocks in the host tier, `kv_offload_memory`, are not reported); `lora_id` is the
adapter's `lora_int_id`. Invariant: replaying every batch of one engine from its start gives exactly the hashes in
its prefix cache (`BlockManager.cached`)."""

import time
from typing import Any

import msgspec

SEND_HWM = 100_000  # batches queued for a slow subscriber before PUB drops them (vLLM's default `hwm`)


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """One change to the set of blocks an engine's prefix cache holds."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def endpoint_for(endpoint: str, rank: int | None) -> str:
    """Replica `rank`'s endpoint: the port moved up by the rank (vLLM's scheme), so that each replica publishes on
    its own socket; an ipc:// or inproc:// path gets `_rank` appended."""
    if not rank:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, port = endpoint.rsplit(":", 1)
        return f"{host}:{int(port) + rank}"
    return f"{endpoint}_{rank}"


class KVEventPublisher:
    """A ZMQ PUB socket bound at `endpoint`: `publish(events)` sends them as one batch (none when empty)."""

    def __init__(self, endpoint: str, topic: str = "", data_parallel_rank: int | None = None):
        import zmq

        self.endpoint = endpoint_for(endpoint, data_parallel_rank)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._socket.bind(self.endpoint)
        self._topic, self._rank, self._seq = topic.encode(), data_parallel_rank, 0
        self._encoder = msgspec.msgpack.Encoder()

    def publish(self, events: list[Any]) -> None:
        if not events:
            return
        payload = self._encoder.encode(KVEventBatch(time.time(), events, self._rank))
        self._socket.send_multipart([self._topic, self._seq.to_bytes(8, "big"), payload])
        self._seq += 1

    def close(self) -> None:
        self._socket.close(linger=1000)  # what is queued still goes out
        self._context.term()
