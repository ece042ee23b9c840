"""The host tiers' bookkeeping: the prefix cache's host tier (LRU, bounded, a hash stored once, pinned blocks kept)
and the swap region, checked against a model of what each device and host block holds once a step's copies run
in their order (offloads, then loads) and its forward writes what it computes."""

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tiffin.engine.config import EngineConfig
from tiffin.engine.core.block_manager import BlockManager
from tiffin.engine.core.kv_offload import HostTier, SwapSpace
from tiffin.engine.core.scheduler import Scheduler
from tiffin.engine.core.sequence import Sequence
from tiffin.engine.sampling_params import SamplingParams

BLOCK = 4


def make_seq(tokens):
    return Sequence("r", 0, tokens, SamplingParams(temperature=0, max_tokens=4), 4)


def test_host_tier_is_lru_bounded_and_stores_a_hash_once():
    tier = HostTier(2)
    a, b = tier.store(b"a"), tier.store(b"b")
    assert {a, b} == {0, 1} and tier.store(b"a") is None  # stored once: nothing to copy
    tier.pinned.clear()
    assert tier.lookup(b"a") == a  # most recent now: b goes first
    tier.pinned.clear()
    assert tier.store(b"c") == b and b"b" not in tier.blocks and tier.evictions == 1
    assert tier.lookup(b"b") is None and len(tier.blocks) == 2
    tier.check_invariants()
    assert tier.lookup(b"a") == a  # a load reads a, an offload writes c: both pinned until the copies are taken
    assert tier.store(b"d") is None and list(tier.blocks) == [b"c", b"a"]
    tier.pinned.clear()
    assert tier.store(b"d") == b and list(tier.blocks) == [b"a", b"d"]
    tier.check_invariants()


def test_swap_space_holds_released_blocks_until_the_copies_are_taken():
    bm = BlockManager(8, BLOCK, swap_blocks=3, host_tier_blocks=2)
    assert isinstance(bm.swap, SwapSpace) and bm.swap.first == 2
    seq = make_seq(list(range(9)))
    assert bm.allocate_slots(seq, 9)
    seq.num_computed_tokens = 9
    table = list(seq.block_table)
    assert bm.swap_out(seq) and seq.block_table == [] and bm.num_free_blocks == 8
    assert sorted(seq.swap_blocks) == [2, 3, 4] and bm.swap.num_used_blocks == 3
    assert bm.take_copies().offloads == list(zip(table, seq.swap_blocks))
    other = make_seq(list(range(50, 55)))
    assert bm.allocate_slots(other, 5)
    other.num_computed_tokens = 5
    assert not bm.swap_out(other)  # the region is full: the caller recomputes
    bm.check_invariants([seq, other])
    bm.free_seq(other)
    swap_blocks = seq.swap_blocks
    assert bm.swap_in(seq, 1)
    assert bm.swap.num_used_blocks == 0 and bm.swap.free == [] and len(seq.block_table) == 3
    assert seq.block_table[:2] == table[:2]  # its full blocks are still cached: only the partial one is loaded
    assert bm.take_copies().loads == [(swap_blocks[2], seq.block_table[2])]
    assert len(bm.swap.free) == 3  # reusable once the step that reads them has its copies
    bm.check_invariants([seq])


class Contents:
    """What each device and host block holds: a block's hash once the step that computes it ran."""

    def __init__(self):
        self.device, self.host = {}, {}

    def run_step(self, bm: BlockManager, computed: list[tuple[Sequence, int]]) -> None:
        copies = bm.take_copies()
        for device, host in copies.offloads:
            self.host[host] = self.device.get(device)
        for host, device in copies.loads:
            self.device[device] = self.host.get(host)
        for seq, first_block in computed:  # the forward writes the blocks past the prefix found
            hashes = bm._hashes(seq, seq.num_tokens // BLOCK)
            for i in range(first_block, len(seq.block_table)):
                self.device[seq.block_table[i]] = hashes[i] if i < len(hashes) else ("partial", seq.seq_id)
            seq.num_computed_tokens = seq.num_tokens

    def check(self, bm: BlockManager, live: list[Sequence]) -> None:
        for block_hash, block in bm.cached.items():
            assert self.device[block] == block_hash, "a cached device block holds other KV"
        for block_hash, block in bm.tier.blocks.items():
            assert self.host[block] == block_hash, "a host-tier block holds other KV"
        for seq in live:
            hashes = bm._hashes(seq, seq.num_tokens // BLOCK)
            assert [self.device[b] for b in seq.block_table[: len(hashes)]] == hashes


DOCS = [list(range(100, 136)), list(range(100, 112)) + [1] * 24, list(range(100, 120)) + [2] * 16]
prompts = st.builds(lambda doc, n: DOCS[doc][:n], st.integers(0, 2), st.integers(1, 36))  # sharing long prefixes


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("admit pool free swap_out swap_in".split()), prompts),
        min_size=10,
        max_size=60,
    ),
    st.integers(6, 16),
    st.integers(1, 6),
    st.integers(0, 8),
)
@example(  # a prefix of device, tier and device blocks, as `interleaved_prefix` builds it (a step every third op)
    [("admit", DOCS[0][:25]), ("pool", DOCS[0]), ("swap_in", [])]
    + [("free", []), ("free", []), ("pool", DOCS[1]), ("free", []), ("admit", DOCS[0]), ("swap_in", [])],
    16,
    2,
    0,
)
def test_copies_keep_every_block_what_its_hash_says(ops, num_blocks, tier_blocks, swap_blocks):
    """Random admissions (device and host-tier hits interleaved), pooling ones (no hits: their copies of cached blocks
    stay unhashed, so the blocks after them may outlive the cached ones), frees, swaps out and in, several per step:
    after each step's copies and forward, every cached block (device or host tier) and every live sequence's block holds
    the KV of its hash; the bookkeeping's invariants hold throughout; the tier never exceeds its blocks. As in the
    scheduler, a sequence admitted or swapped in is neither freed nor swapped out before its step runs."""
    bm = BlockManager(num_blocks, BLOCK, host_tier_blocks=tier_blocks, swap_blocks=swap_blocks)
    contents, live, swapped, computed = Contents(), [], [], []
    for i, (op, prompt) in enumerate(ops):
        settled = [s for s in live if s.num_computed_tokens == s.num_tokens]  # their step ran
        if op in ("admit", "pool"):
            seq = make_seq(prompt)
            cached = bm.get_computed_blocks(seq) if op == "admit" else []
            if bm.allocate_slots(seq, seq.num_tokens - len(cached) * BLOCK, cached):
                seq.num_computed_tokens = len(cached) * BLOCK
                live.append(seq)
                computed.append((seq, len(cached)))
        elif op == "free" and settled:
            seq = settled[len(prompt) % len(settled)]
            live.remove(seq)
            bm.free_seq(seq)
        elif op == "swap_out" and settled:
            seq = settled[len(prompt) % len(settled)]
            if bm.swap_out(seq):
                live.remove(seq)
                swapped.append(seq)
        elif op == "swap_in" and swapped and bm.swap_in(swapped[0], 0):
            seq = swapped.pop(0)
            seq.num_computed_tokens -= 1  # settled once its step ran
            live.append(seq)
            computed.append((seq, len(seq.block_table)))
        bm.check_invariants(live + swapped)
        if i % 3 == 2:
            contents.run_step(bm, computed)
            computed = []
            contents.check(bm, live)
            assert bm.tier.num_used_blocks <= tier_blocks
    contents.run_step(bm, computed)
    contents.check(bm, live)
    for seq in live + swapped:
        bm.free_seq(seq)
    bm.take_copies()
    bm.check_invariants([])
    assert bm.num_free_blocks == num_blocks and (bm.swap is None or bm.swap.num_used_blocks == 0)


def test_a_load_continues_the_hash_chain():
    """Blocks evicted to the tier come back under their hash: the next request finds them on the device."""
    bm = BlockManager(4, BLOCK, host_tier_blocks=4)
    first = make_seq(list(range(13)))
    assert bm.allocate_slots(first, 13)
    first.num_computed_tokens = 13
    bm.free_seq(first)
    filler = make_seq(list(range(100, 116)))
    assert bm.allocate_slots(filler, 16)  # evicts all of first's blocks to the tier
    assert len(bm.take_copies().offloads) == 3 and bm.tier.num_used_blocks == 3
    bm.free_seq(filler)
    again = make_seq(list(range(13)))
    assert bm.get_computed_blocks(again) == [None] * 3  # 12 of 13 tokens: the last one is recomputed
    assert bm.allocate_slots(again, 1, [None] * 3)
    assert [b for _, b in bm.take_copies().loads] == again.block_table[:3]
    third = make_seq(list(range(13)))
    assert bm.get_computed_blocks(third) == again.block_table[:3]
    bm.check_invariants([again])


def test_check_invariants_covers_the_host_tiers():
    bm = BlockManager(4, BLOCK, host_tier_blocks=2, swap_blocks=2)
    bm.tier.store(b"x")
    bm.tier.free.append(bm.tier.blocks[b"x"])
    with pytest.raises(AssertionError, match="lost or free twice"):
        bm.check_invariants([])
    bm = BlockManager(4, BLOCK, swap_blocks=2)
    seq = make_seq([1, 2, 3])
    seq.swap_blocks = [2]
    with pytest.raises(AssertionError, match="swap block"):
        bm.check_invariants([seq])


def test_a_host_block_loaded_in_a_step_is_not_overwritten_in_it():
    """A one-block tier: an admission loads its prefix from it while its allocation evicts another hashed block;
    that block is not offloaded over the one being read (offloads run first)."""
    bm = BlockManager(2, BLOCK, host_tier_blocks=1)
    for tokens in (range(5), range(100, 105)):  # the second evicts the first's full block to the tier
        seq = make_seq(list(tokens))
        assert bm.allocate_slots(seq, 5)
        seq.num_computed_tokens = 5
        bm.free_seq(seq)
    assert bm.take_copies().offloads == [(0, 0)]
    again = make_seq(list(range(5)))
    assert bm.get_computed_blocks(again) == [None] and bm.allocate_slots(again, 1, [None])
    copies = bm.take_copies()
    assert copies.offloads == [] and copies.loads == [(0, again.block_table[0])]
    bm.check_invariants([again])


def interleaved_prefix(bm: BlockManager) -> tuple[list[int], list[int]]:
    """Leaves the 10 full blocks of tokens 0..40 cached as device, device, device, device, tier, tier, device x4:
    a request of 25 tokens caches blocks 0-5, a pooling one of 41 (which takes no hits) caches 6-9 (its copies of
    0-5 stay unhashed: their hashes are cached), and a filler evicts 5 and 4 (the first one's, freed before the
    pooling one's 6-9) to the tier. Returns the tokens and the device blocks of 0-3 and 6-9."""
    first, pooled = make_seq(list(range(25))), make_seq(list(range(41)))
    for seq in (first, pooled):
        assert bm.allocate_slots(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
    device = first.block_table[:4] + pooled.block_table[6:10]
    bm.free_seq(first)
    bm.free_seq(pooled)
    filler = make_seq(list(range(100, 140)))  # 8 unhashed blocks go first, then blocks 5 and 4
    assert bm.allocate_slots(filler, 40)
    filler.num_computed_tokens = 40
    assert len(bm.take_copies().offloads) == 2 and len(bm.tier.blocks) == 2
    bm.free_seq(filler)
    return list(range(41)), device


def test_a_prefix_runs_through_device_and_tier_hits_in_any_order():
    """Device hits past a tier hit are shared, not recomputed: only the blocks the tier holds are loaded, into
    fresh blocks at their place in the table, which a full tier does not drop while their loads are pending."""
    bm = BlockManager(18, BLOCK, host_tier_blocks=2)
    tokens, device = interleaved_prefix(bm)
    tier = dict(bm.tier.blocks)
    scheduler = Scheduler(EngineConfig(model="-", block_size=BLOCK), bm, max_model_len=1000)
    again = make_seq(tokens)
    scheduler.add(again)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == [1] and again.num_computed_tokens == 40  # the last token is recomputed
    assert again.block_table[:4] + again.block_table[6:10] == device
    loads = bm.take_copies().loads
    assert loads == [(tier[again.block_hashes[i]], again.block_table[i]) for i in (4, 5)]
    assert bm.tier.blocks == tier  # pinned: the filler's blocks evicted for the new ones were not stored over them
    assert (bm.prefix_cache_hits, bm.host_tier_hits, scheduler.num_prefill_tokens) == (40, 8, 1)
    assert bm.get_computed_blocks(make_seq(tokens)) == again.block_table[:10]  # loaded blocks are cached again
    bm.check_invariants([again])


def test_a_failed_allocation_after_a_lookup_changes_nothing():
    """The lookup pins nothing and touches no LRU order: an admission the pool cannot hold leaves the pool, the
    tier's blocks and their order, and the pending copies as they were."""
    bm = BlockManager(18, BLOCK, host_tier_blocks=2)
    tokens, device = interleaved_prefix(bm)
    seq = make_seq(tokens + list(range(200, 240)))  # its prefix, then 11 more blocks: 13 new ones, 10 are free
    cached = bm.get_computed_blocks(seq)
    assert cached == device[:4] + [None, None] + device[4:]
    before = (list(bm.free), list(bm.ref_cnt), list(bm.block_hash), list(bm.tier.blocks.items()))
    assert not bm.allocate_slots(seq, seq.num_tokens - 40, cached)
    assert (list(bm.free), list(bm.ref_cnt), list(bm.block_hash), list(bm.tier.blocks.items())) == before
    assert seq.block_table == [] and not bm.tier.pinned and not bm.pending
    bm.check_invariants([])


def test_swap_in_shares_the_blocks_still_cached():
    """A swapped-out sequence whose block 3 was evicted meanwhile gets its blocks 0-2 back from the prefix cache and
    loads only blocks 3 and 4 (partial) from its swap blocks, all of which it gives back."""
    bm = BlockManager(9, BLOCK, swap_blocks=5)
    seq = make_seq(list(range(19)))
    assert bm.allocate_slots(seq, 19)
    seq.num_computed_tokens = 18  # its last token is to be computed when it resumes
    table = list(seq.block_table)
    assert bm.swap_out(seq)
    bm.take_copies()
    filler = make_seq(list(range(100, 124)))  # 2 unhashed blocks go first, 4 never used, then block 3
    assert bm.allocate_slots(filler, 24)
    filler.num_computed_tokens = 24
    bm.free_seq(filler)
    swap_blocks = seq.swap_blocks
    assert bm.swap_in(seq, 1)
    assert seq.block_table[:3] == table[:3] and len(seq.block_table) == 5
    assert bm.take_copies().loads == [(swap_blocks[i], seq.block_table[i]) for i in (3, 4)]
    assert seq.swap_blocks == [] and bm.swap.num_used_blocks == 0
    bm.check_invariants([seq])
