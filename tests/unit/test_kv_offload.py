"""The host tiers' bookkeeping: the prefix cache's host tier (LRU, bounded, a hash stored once, pinned blocks kept)
and the swap region, checked against a model of what each device and host block holds once a step's copies run
in their order (offloads, then loads) and its forward writes what it computes."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiffin.engine.core.block_manager import BlockManager
from tiffin.engine.core.kv_offload import HostTier, SwapSpace
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


tokens = st.lists(st.integers(0, 2), min_size=1, max_size=20)  # tiny alphabet: shared prefixes are common


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from("admit free swap_out swap_in".split()), tokens), min_size=1, max_size=40),
    st.integers(6, 16),
    st.integers(1, 6),
    st.integers(0, 8),
)
def test_copies_keep_every_block_what_its_hash_says(ops, num_blocks, tier_blocks, swap_blocks):
    """Random admissions (device and host-tier hits interleaved), frees, swaps out and in, several per step: after each
    step's copies and forward, every cached block (device or host tier) and every live sequence's block holds
    the KV of its hash; the bookkeeping's invariants hold throughout; the tier never exceeds its blocks. As in the
    scheduler, a sequence admitted or swapped in is neither freed nor swapped out before its step runs."""
    bm = BlockManager(num_blocks, BLOCK, host_tier_blocks=tier_blocks, swap_blocks=swap_blocks)
    contents, live, swapped, computed = Contents(), [], [], []
    for i, (op, prompt) in enumerate(ops):
        settled = [s for s in live if s.num_computed_tokens == s.num_tokens]  # their step ran
        if op == "admit":
            seq = make_seq(prompt)
            cached = bm.get_computed_blocks(seq)
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
