"""Host memory behind the KV pool, bookkept here, copied by the worker: the prefix cache's host tier (blocks evicted
from the pool, least recently used dropped first) and the swap region (the blocks of sequences preempted by swap).

Host block ids: the tier's are 0..tier_blocks-1, the swap region's follow. The worker holds each in tensors of its
own (the tier's may store another format: `kv_offload_dtype`), numbered from 0 by `KVCopies.split`.

A step's copies (`KVCopies`, taken from the BlockManager once the step is scheduled) take effect in this order:
every offload reads its device block, then every load writes its device block, then the step's forward runs; an
offload's host block holds its bytes before a load of its step or a later step's copy reads or writes it. The
worker keeps this order (`ModelRunner.copy_blocks`; on CUDA an offload's device -> host copy overlaps the
forward). Hence:
- a device block evicted or swapped out, then reallocated in the same step, is read before a load or the forward
  writes it. A device block a load writes is held by the sequence admitted or swapped in with it, which is
  neither freed nor preempted before the step's forward (the scheduler preempts before it admits), so no offload
  of the step reads it (`BlockManager._offload` asserts it);
- a host block that the step's copies read or write is pinned until they are taken: it is neither dropped from the
  tier nor reused, so no offload overwrites what a load of the same step reads, and no two offloads of a step write
  one host block (a load may read what an offload of its step wrote: offloads take effect first).
Copies not taken (a step that runs nothing) stay pending for the next step, in the same order.
"""

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class KVCopies:
    offloads: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)

    def __bool__(self) -> bool:
        return bool(self.offloads or self.loads)

    def split(self, tier_blocks: int) -> tuple["KVCopies", "KVCopies"]:
        """The copies of the tier's host blocks and those of the swap region's, its ids less `tier_blocks`."""
        tier = KVCopies([c for c in self.offloads if c[1] < tier_blocks], [c for c in self.loads if c[0] < tier_blocks])
        swap = KVCopies(
            [(block, host - tier_blocks) for block, host in self.offloads if host >= tier_blocks],
            [(host - tier_blocks, block) for host, block in self.loads if host >= tier_blocks],
        )
        return tier, swap


class HostTier:
    """The prefix cache's host tier: full blocks by hash, bounded, least recently used dropped first; a hash is
    stored once."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.blocks: OrderedDict[bytes, int] = OrderedDict()  # hash -> host block, least recently used first
        self.free = list(range(num_blocks))
        self.pinned: set[int] = set()  # touched by the pending copies
        self.evictions = 0  # blocks dropped to make room

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks)

    def lookup(self, block_hash: bytes) -> int | None:
        """The host block holding `block_hash`, pinned and made most recent; None if absent."""
        block = self.blocks.get(block_hash)
        if block is not None:
            self.blocks.move_to_end(block_hash)
            self.pinned.add(block)
        return block

    def store(self, block_hash: bytes) -> int | None:
        """The host block to copy a block of `block_hash` into (pinned), dropping the least recently used unpinned
        one if full; None when there is nothing to copy: the hash is stored already (it is made most recent), or
        every host block is pinned."""
        if block_hash in self.blocks:
            self.blocks.move_to_end(block_hash)
            return None
        if not self.free:
            victim = next((h for h, b in self.blocks.items() if b not in self.pinned), None)
            if victim is None:
                return None
            self.free.append(self.blocks.pop(victim))
            self.evictions += 1
        block = self.blocks[block_hash] = self.free.pop()
        self.pinned.add(block)
        return block

    def check_invariants(self) -> None:
        held = list(self.blocks.values())
        assert len(set(held)) == len(held), "a host block holds two hashes"
        assert sorted(held + self.free) == list(range(self.num_blocks)), "a host block is lost or free twice"
        assert self.pinned <= set(held), "a pinned host block holds no hash"


class SwapSpace:
    """The swap region: host blocks `first`..`first + num_blocks - 1`. Blocks given back wait in `released` until
    the pending copies are taken (a swap-in of this step may still read them)."""

    def __init__(self, first: int, num_blocks: int):
        self.first, self.num_blocks = first, num_blocks
        self.free = list(range(first + num_blocks - 1, first - 1, -1))
        self.released: list[int] = []

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free) - len(self.released)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        blocks = self.free[len(self.free) - n :]
        del self.free[len(self.free) - n :]
        return blocks

    def check_invariants(self, held: list[int]) -> None:
        everything = held + self.free + self.released
        assert sorted(everything) == list(range(self.first, self.first + self.num_blocks)), "a swap block is lost"
