"""Which replica of a data-parallel engine serves a request (tiffin.engine.data_parallel).

`cache_aware` (SGLang's model gateway's idea, fed by the engines' own KV events as Dynamo's router is): a request's
prompt blocks are hashed as the replicas' prefix caches hash them (`block_manager.block_hashes`: the same block
size and chain, the adapter's identity and the images' hashes included). A replica holds a block if its KV events
(tiffin.engine.kv_events) say so, or if a prompt routed to it and still in flight has it (a burst of requests
sharing a system prompt arrives before any of them is computed). The request goes to the replica holding its
longest leading run of blocks, unless that replica's load (tokens of its requests in flight, waiting and running;
under priorities or fair share, those the request could not overtake there: tiffin.engine.replica_work) exceeds the
least loaded one's by more than `balance_threshold` tokens; without any hit, to the least loaded
replica among those holding its adapter (LoRA affinity: the replica it was added on, and those sent its requests,
which read it then), within the same bound; else to the least loaded one (which reads the adapter). `least_loaded`
and `round_robin` ignore the cache. Equal loads go to the replica with the lower tie-break (the front's: the smaller
total load), then the lowest index; a replica whose load is infinite (dead, its queue full, or, under priorities or
fair share, one that would not seat the request at once while another would) is chosen only when every replica is.
`lora_replicas` does not follow a replica's host cache: an adapter it evicted is read again when a request brings it
back.

`blocks` is exactly what the events said, as of each replica's last report (a block stored or evicted meanwhile is
seen one step late); `inflight` is the router's own record of what it sent, each prompt's hashes until the front
calls `finished` for it."""

from collections import Counter
from collections.abc import Sequence as Seq

from tiffin.engine.config import ROUTER_POLICIES
from tiffin.engine.core.block_manager import block_hashes
from tiffin.engine.core.sequence import Sequence
from tiffin.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from tiffin.engine.sampling_params import SamplingParams

_HASH_PARAMS = SamplingParams(max_tokens=1)


class Router:
    def __init__(self, num_replicas: int, block_size: int, policy: str = "cache_aware", balance_threshold: int = 0):
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"router_policy must be one of {list(ROUTER_POLICIES)}, got {policy!r}")
        self.block_size, self.policy, self.balance_threshold = block_size, policy, balance_threshold
        self.blocks: list[set[bytes]] = [set() for _ in range(num_replicas)]  # the hashes each replica holds
        self.inflight: list[Counter] = [Counter() for _ in range(num_replicas)]  # those of its prompts in flight
        self.lora_replicas: dict[int, set[int]] = {}  # lora_int_id -> replicas holding it (added or sent there)
        self._next = 0  # round_robin's
        self.routed_tokens = [0] * num_replicas  # prompt tokens routed to each replica, and those it held
        self.expected_hits = [0] * num_replicas

    def apply_events(self, replica: int, events: list) -> None:
        """Update `replica`'s held hashes from its KV events, in order."""
        held = self.blocks[replica]
        for event in events:
            if isinstance(event, BlockStored):
                held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                held.clear()

    def forget(self, replica: int) -> None:
        """`replica` died: it holds nothing, serves no adapter and computes nothing (its replacement starts empty)."""
        self.blocks[replica].clear()
        self.inflight[replica].clear()
        for replicas in self.lora_replicas.values():
            replicas.discard(replica)

    def prompt_hashes(self, token_ids: list[int], cache_key: bytes = b"", images: tuple = ()) -> list[bytes]:
        """The hashes a replica's prefix cache would look up for this prompt (stopping short of its last token, which
        is always computed); `cache_key`: its adapter's identity (b"": the base model)."""
        seq = Sequence("", 0, token_ids, _HASH_PARAMS, 1, images=images)
        seq.cache_key = cache_key
        return block_hashes(seq, self.block_size, (len(token_ids) - 1) // self.block_size)

    def route(
        self, hashes: list[bytes], loads: Seq[float], lora_id: int | None = None, tiebreak: Seq[int] | None = None
    ) -> int:
        """The replica for a request with prompt block `hashes` (`prompt_hashes`), given each replica's load in
        tokens as this request sees it (tiffin.engine.replica_work), equal loads going to the lower `tiebreak` (the
        replicas' total loads); records the choice (LoRA affinity, expected hits)."""
        replica = self._choose(hashes, loads, lora_id, tiebreak or [0] * len(loads))
        if lora_id is not None:
            self.lora_replicas.setdefault(lora_id, set()).add(replica)
        self.routed_tokens[replica] += len(hashes) * self.block_size
        self.expected_hits[replica] += self.hit_blocks(replica, hashes) * self.block_size
        self.inflight[replica].update(hashes)
        return replica

    def finished(self, replica: int, hashes: list[bytes]) -> None:
        """A request routed to `replica` with prompt block `hashes` is no longer in flight."""
        inflight = self.inflight[replica]
        for h in hashes:
            inflight[h] -= 1
            if not inflight[h]:
                del inflight[h]

    def hit_blocks(self, replica: int, hashes: list[bytes]) -> int:
        """How many leading blocks of `hashes` `replica` holds or is computing."""
        held, inflight, n = self.blocks[replica], self.inflight[replica], 0
        while n < len(hashes) and (hashes[n] in held or hashes[n] in inflight):
            n += 1
        return n

    def _choose(self, hashes: list[bytes], loads: Seq[float], lora_id: int | None, tiebreak: Seq[int]) -> int:
        replicas = range(len(self.blocks))
        least = min(replicas, key=lambda r: (loads[r], tiebreak[r]))
        if self.policy == "round_robin":
            for _ in replicas:
                replica, self._next = self._next, (self._next + 1) % len(self.blocks)
                if loads[replica] != float("inf"):
                    return replica
            return least
        if self.policy == "least_loaded":
            return least
        hits = [self.hit_blocks(r, hashes) for r in replicas]
        best = max(replicas, key=lambda r: (hits[r], -loads[r], -tiebreak[r]))
        if hits[best] == 0:
            served = self.lora_replicas.get(lora_id, ()) if lora_id is not None else ()
            best = min(served, key=lambda r: (loads[r], tiebreak[r], r), default=least)
        return best if loads[best] - loads[least] <= self.balance_threshold else least
