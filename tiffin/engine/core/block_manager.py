"""KV-cache block bookkeeping: a pool of fixed-size blocks, per-sequence block tables, and prefix caching.

Invariants kept here:
- A block is either referenced (ref_cnt > 0, in at least one block table) or in the free queue, never both.
- A block carries a hash only once every token slot in it is filled (it is "full"); a hashed block is never
  written again, so sequences may share it. Block tables are append-only while a sequence holds its blocks.
- Freed hashed blocks stay findable in the free queue, oldest-freed evicted first; unhashed ones are reused
  before them. A hash leaves the map only when its block is reallocated.
- The last token of a sequence is always recomputed: a prefix-cache hit never covers it, since its logits
  are needed.
- A block's hash covers the hashes of the images whose placeholders it holds (`Sequence.block_key`): blocks of the
  same tokens over different images never match.
- Hashes cover a sequence's tokens only, never proposals beyond them (speculative decoding): slots a step
  fills for proposals that are then rejected are written again before a hash can cover them.
- Host tier (`kv_offload.HostTier`, with prefix caching): a hashed block reallocated has its contents offloaded
  to the tier first, unless the tier holds its hash already. An admission's prefix runs as long as each next hash
  is on the device (looked up first) or in the tier, in any interleaving: device hits are shared, tier hits loaded
  into fresh device blocks at their place in the table, which take their hash again; both count as prefix-cache
  hits (the last token still recomputed). A lookup touches nothing: the allocation that loads a tier block pins it.
- Swap (`kv_offload.SwapSpace`): a sequence holds device blocks or swap blocks, never both; a swapped-out one
  keeps its num_computed_tokens, its swap blocks holding the blocks of those tokens until it is swapped in (or
  freed). Swapped in, its full blocks still in the prefix cache are shared; only the others are loaded.
- Every copy between device and host goes through `pending`, taken once per step (`take_copies`), in the order
  and with the pinning `kv_offload` states.
- KV events (`events` a list, tiffin.engine.kv_events): a hash entering `cached` is a BlockStored, one leaving it a
  BlockRemoved, a reset AllBlocksCleared, in the order they happen; replayed, they give `cached`'s keys exactly.
"""

import hashlib
from array import array
from collections import Counter, OrderedDict
from collections.abc import Iterable

from tiffin.engine.core.kv_offload import HostTier, KVCopies, SwapSpace
from tiffin.engine.core.sequence import Sequence
from tiffin.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored


def hash_block(parent: bytes, token_ids: list[int], extra_key: bytes = b"") -> bytes:
    """Identity of a full block: its tokens, everything before it (the parent's hash), and extra keys such
    as the LoRA adapter it was computed with."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes() + extra_key).digest()


def block_hashes(seq: Sequence, block_size: int, num_blocks: int) -> list[bytes]:
    """Hash chain of `seq`'s first `num_blocks` full blocks, memoised on the sequence: what the prefix cache looks
    up (a router hashes a prompt with it too)."""
    hashes = seq.block_hashes
    for i in range(len(hashes), num_blocks):
        parent = hashes[-1] if hashes else b""
        tokens = seq.token_ids[i * block_size : (i + 1) * block_size]
        hashes.append(hash_block(parent, tokens, seq.block_key(i * block_size, (i + 1) * block_size)))
    return hashes[:num_blocks]


class BlockManager:
    # where a sequence keeps its table and hashed-block count in this pool (`window_blocks` keeps a second pool's)
    table_attr, hashed_attr = "block_table", "num_hashed_blocks"
    null_block = -1  # a table entry that holds no block (`window_blocks`: slots left behind the window)

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        host_tier_blocks: int = 0,
        swap_blocks: int = 0,
    ):
        """`host_tier_blocks`: host blocks of the prefix cache's tier (ids 0..), `swap_blocks` those of the swap
        region (the ids after them); 0: none."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block id
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found, host-tier hits included
        self.host_tier_hits = 0  # tokens loaded from the host tier
        self.tier = HostTier(host_tier_blocks) if host_tier_blocks and enable_prefix_caching else None
        self.swap = SwapSpace(host_tier_blocks, swap_blocks) if swap_blocks else None
        self.pending = KVCopies()  # the copies of the step being scheduled
        self.events: list | None = None  # KV events since `take_events` (None: not recorded)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, seq: Sequence) -> list[int | None]:
        """The longest cached full-block prefix of `seq`, stopping short of its last token: each block's device
        block, or None where the host tier holds its hash. Touches nothing: `allocate_slots` takes them."""
        if not self.enable_prefix_caching:
            return []
        blocks = []
        for block_hash in self._hashes(seq, (seq.num_tokens - 1) // self.block_size):
            block = self.cached.get(block_hash)
            if block is None and (self.tier is None or block_hash not in self.tier.blocks):
                break
            blocks.append(block)
        return blocks

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int | None] = ()) -> bool:
        """Extend `seq`'s block table to hold its computed tokens, `computed_blocks` (`get_computed_blocks` of a
        sequence being admitted: its device blocks shared, its host-tier blocks loaded into fresh ones) and
        `num_new_tokens` more. False, changing nothing, if the pool is short."""
        num_tokens = max(seq.num_computed_tokens, len(computed_blocks) * self.block_size) + num_new_tokens
        num_blocks = self.blocks_needed(num_tokens)
        if not self._has_room(computed_blocks, num_blocks - len(self.table(seq))):
            return False
        hashes = self._hashes(seq, len(computed_blocks))
        loads = {i: self.tier.lookup(hashes[i]) for i, block in enumerate(computed_blocks) if block is None}
        self._extend(seq, computed_blocks, loads, num_blocks)
        if self.enable_prefix_caching:
            self._cache_full_blocks(seq, min(num_tokens, seq.num_tokens) // self.block_size)
        return True

    def _has_room(self, hits: list[int | None], num_blocks: int) -> bool:
        """Whether the pool holds `num_blocks` more blocks for a table, the cached blocks of `hits` among them."""
        hits = [block for block in hits if block is not None]
        return num_blocks - len(hits) <= len(self.free) - sum(1 for block in hits if self.ref_cnt[block] == 0)

    def _extend(self, seq: Sequence, hits: list[int | None], loads: dict[int, int], num_blocks: int) -> None:
        """Extend `seq`'s table to `num_blocks` blocks: at position i the cached block `hits[i]`, shared, else a fresh
        one, loaded from host block `loads[i]` if any. The host blocks are pinned (tier) or held (swap) already:
        popping fresh blocks, which offloads evicted ones to the tier, overwrites none of them."""
        for block in hits:  # out of the free queue before any block is popped: popping evicts no hit
            if block is not None:
                if self.ref_cnt[block] == 0:
                    del self.free[block]
                self.ref_cnt[block] += 1
        table = self.table(seq)
        for i in range(len(table), num_blocks):
            block = hits[i] if i < len(hits) and hits[i] is not None else self._pop_free()
            if i in loads:
                self.pending.loads.append((loads[i], block))
            table.append(block)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks of `seq`'s table past its first `num_tokens` slots (rejected proposals'); they
        hold no hash."""
        keep, table = self.blocks_needed(num_tokens), self.table(seq)
        self._release(reversed(table[keep:]))
        del table[keep:]

    def _release(self, blocks: Iterable[int]) -> None:
        """Drop a reference to each block (the null block aside); unhashed ones freed are reused first, hashed ones
        last."""
        for block in blocks:
            if block == self.null_block:
                continue
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                self.free[block] = None
                if self.block_hash[block] is None:
                    self.free.move_to_end(block, last=False)

    def free_seq(self, seq: Sequence) -> None:
        """Release `seq`'s blocks, tail first, so that under LRU its prefix outlives its suffix, and its swap
        blocks."""
        self._release(reversed(self.table(seq)))
        setattr(seq, self.table_attr, [])
        setattr(seq, self.hashed_attr, 0)
        if seq.swap_blocks:
            self.swap.released += seq.swap_blocks
            seq.swap_blocks = []

    def swap_out(self, seq: Sequence) -> bool:
        """Copy the blocks of `seq`'s computed tokens to swap blocks and free its device blocks. False, changing
        nothing, when there is no swap region, it lacks room, or `seq` has nothing computed."""
        num_blocks = self.blocks_needed(seq.num_computed_tokens)
        host_blocks = None if self.swap is None or not num_blocks else self.swap.allocate(num_blocks)
        if host_blocks is None:
            return False
        for block, host_block in zip(seq.block_table, host_blocks):
            self._offload(block, host_block)
        self.free_seq(seq)
        seq.swap_blocks = host_blocks
        return True

    def swap_in(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give swapped-out `seq` device blocks for its computed tokens and for `num_new_tokens` more: its full blocks
        still in the prefix cache shared, the others loaded from its swap blocks (all given back). False, changing
        nothing, if the pool is short."""
        num_tokens = seq.num_computed_tokens + num_new_tokens
        num_full = seq.num_computed_tokens // self.block_size if self.enable_prefix_caching else 0
        hits = [self.cached.get(block_hash) for block_hash in self._hashes(seq, num_full)]
        if not self._has_room(hits, self.blocks_needed(num_tokens)):
            return False
        loads = {i: block for i, block in enumerate(seq.swap_blocks) if i >= num_full or hits[i] is None}
        self._extend(seq, hits, loads, self.blocks_needed(num_tokens))
        self.swap.released += seq.swap_blocks
        seq.swap_blocks = []
        if self.enable_prefix_caching:
            self._cache_full_blocks(seq, min(num_tokens, seq.num_tokens) // self.block_size)
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's name): the KV they held is gone or stale (sleep, new weights). False,
        changing nothing, while a sequence holds blocks."""
        if self.num_used_blocks or (self.swap is not None and self.swap.num_used_blocks):
            return False
        self.block_hash = [None] * self.num_blocks
        self.cached.clear()
        self.free = OrderedDict.fromkeys(range(self.num_blocks))
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        if self.tier is not None:  # its counters go on
            self.tier.blocks.clear()
            self.tier.free, self.tier.pinned = list(range(self.tier.num_blocks)), set()
        return True

    def take_copies(self) -> KVCopies:
        """The copies pending (the step's, to run before its forward); unpins the host blocks they touch."""
        copies, self.pending = self.pending, KVCopies()
        if self.tier is not None:
            self.tier.pinned.clear()
        if self.swap is not None:
            self.swap.free += self.swap.released
            self.swap.released = []
        return copies

    def forget_uncomputed(self, seq: Sequence) -> None:
        """Unhash `seq`'s blocks that a step was to fill but did not (it failed): their KV is not what the
        hash says, so no later request may find them."""
        for block in self.table(seq)[seq.num_computed_tokens // self.block_size :]:
            if block != self.null_block:
                self._uncache(block)

    def check_invariants(self, seqs: Iterable[Sequence]) -> None:
        """AssertionError unless the invariants above hold, `seqs` being every sequence that holds blocks (device
        or swap ones)."""
        seqs = list(seqs)
        tables = [[block for block in self.table(seq) if block != self.null_block] for seq in seqs]
        assert all(len(set(table)) == len(table) for table in tables), "a table holds a block twice"
        held = Counter(block for table in tables for block in table)
        assert all(self.ref_cnt[block] == n for block, n in held.items()), "a ref count is not its block tables'"
        assert min(self.ref_cnt, default=0) >= 0 and sum(self.ref_cnt) == held.total(), "a block has stray refs"
        assert not held.keys() & self.free.keys(), "a referenced block is in the free queue"
        assert len(self.free) == self.ref_cnt.count(0), "a free block is missing from the free queue"
        assert all(self.block_hash[block] == h for h, block in self.cached.items()), "the hash map disagrees"
        assert len(self.cached) == len(self.block_hash) - self.block_hash.count(None), "a hashed block is unmapped"
        assert not any(seq.block_table and seq.swap_blocks for seq in seqs), "a sequence holds device and swap blocks"
        if self.tier is not None:
            self.tier.check_invariants()
        if self.swap is not None:
            self.swap.check_invariants([block for seq in seqs for block in seq.swap_blocks])

    def _pop_free(self) -> int:
        block, _ = self.free.popitem(last=False)
        old = self.block_hash[block]
        if old is not None:
            self._uncache(block)
            host_block = None if self.tier is None else self.tier.store(old)
            if host_block is not None:
                self._offload(block, host_block)
        self.ref_cnt[block] = 1
        return block

    def _offload(self, block: int, host_block: int) -> None:
        assert all(block != loaded for _, loaded in self.pending.loads), "a block loaded this step is offloaded in it"
        self.pending.offloads.append((block, host_block))

    def _cache_full_blocks(self, seq: Sequence, num_full_blocks: int) -> None:
        hashes, table = self._hashes(seq, num_full_blocks), self.table(seq)
        for i in range(getattr(seq, self.hashed_attr), num_full_blocks):
            block = table[i]
            if block != self.null_block and self.block_hash[block] is None and hashes[i] not in self.cached:
                self.block_hash[block] = hashes[i]
                self.cached[hashes[i]] = block
                if self.events is not None:
                    self._stored(seq, hashes, i)
        setattr(seq, self.hashed_attr, max(getattr(seq, self.hashed_attr), num_full_blocks))

    def _stored(self, seq: Sequence, hashes: list[bytes], i: int) -> None:
        tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
        lora_id = None if seq.lora is None else seq.lora.int_id
        parent = hashes[i - 1] if i else None
        self.events.append(BlockStored([hashes[i]], parent, tokens, self.block_size, lora_id, None))

    def table(self, seq: Sequence) -> list[int]:
        """`seq`'s block table in this pool."""
        return getattr(seq, self.table_attr)

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        return block_hashes(seq, self.block_size, num_blocks)

    def take_events(self) -> list:
        """The KV events recorded since the last call (recording goes on)."""
        events, self.events = self.events, []
        return events

    def _uncache(self, block: int) -> None:
        """Take `block`'s hash out of the prefix cache."""
        old, self.block_hash[block] = self.block_hash[block], None
        if old is not None and self.cached.get(old) == block:
            del self.cached[old]
            if self.events is not None:
                self.events.append(BlockRemoved([old], None))
