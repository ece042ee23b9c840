"""The data-parallel router on fake loads, and the block pool's KV events: the router hashes a prompt as the prefix
cache does (checked against a BlockManager that computed the prompt), picks the replica holding the longest prefix
unless it is loaded past the bound, follows stored / removed / cleared events, prefers a replica that served the
adapter; the events a pool records under random allocation, eviction and resets replay to its cached hashes."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiffin.engine.core.block_manager import BlockManager
from tiffin.engine.core.sequence import Sequence
from tiffin.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from tiffin.engine.router import Router
from tiffin.engine.sampling_params import SamplingParams

BLOCK = 4


def computed(bm: BlockManager, tokens: list[int], cache_key: bytes = b"") -> Sequence:
    """A sequence whose prompt the pool has computed (its blocks allocated and hashed)."""
    seq = Sequence("r", 0, tokens, SamplingParams(max_tokens=1), 1)
    seq.cache_key = cache_key
    assert bm.allocate_slots(seq, len(tokens), bm.get_computed_blocks(seq))
    seq.num_computed_tokens = len(tokens)
    return seq


def stored(hashes: list[bytes]) -> list[BlockStored]:
    return [BlockStored([h], None, [], BLOCK, None, None) for h in hashes]


def route_alone(router: Router, hashes: list[bytes], loads: list[int], lora_id: int | None = None) -> int:
    """Route a request that then finishes at once: only the events' map decides the next."""
    replica = router.route(hashes, loads, lora_id)
    router.finished(replica, hashes)
    return replica


def test_prompt_hashes_are_the_prefix_caches():
    bm = BlockManager(16, BLOCK)
    bm.events = []
    tokens = list(range(100, 114))  # 3 full blocks and 2 tokens
    computed(bm, tokens)
    router = Router(2, BLOCK)
    router.apply_events(1, bm.take_events())
    hashes = router.prompt_hashes(tokens)
    assert len(hashes) == 3 and router.blocks[1] == set(hashes) == set(bm.cached)
    # the last token is always computed: a prompt of exactly 3 blocks looks up 2
    assert router.prompt_hashes(tokens[:12]) == hashes[:2]
    # an adapter's blocks are its own
    lora = router.prompt_hashes(tokens, b"adapter")
    assert not set(lora) & set(hashes)
    computed(bm, tokens, b"adapter")
    assert set(lora) <= set(bm.cached)


def test_cache_aware_picks_the_longest_prefix_within_the_bound():
    router = Router(3, BLOCK, "cache_aware", balance_threshold=100)
    hashes = router.prompt_hashes(list(range(1, 18)))  # 4 blocks
    router.apply_events(1, stored(hashes[:2]))
    router.apply_events(2, stored(hashes[:3]))
    assert route_alone(router, hashes, [0, 50, 60]) == 2
    assert route_alone(router, hashes, [0, 50, 101]) == 0  # replica 2 past the bound: the least loaded
    assert route_alone(router, hashes, [0, 50, 100]) == 2
    other = router.prompt_hashes(list(range(2, 19)))  # its first block differs: its chain shares no hash
    assert route_alone(router, other, [0, 0, 0]) == 0  # no leading block held: the least loaded, lowest index
    router.apply_events(2, [BlockRemoved([hashes[1]], None)])  # its run now ends at block 0
    assert route_alone(router, hashes, [0, 50, 60]) == 1
    router.apply_events(1, [AllBlocksCleared()])
    assert route_alone(router, hashes, [30, 50, 60]) == 2
    assert router.expected_hits == [0, 2 * BLOCK, (3 + 3 + 1) * BLOCK]


def test_a_burst_sharing_a_prefix_follows_the_first_until_it_finishes():
    """Prompts routed and still in flight count as held: a burst over one system prompt stays together."""
    router = Router(2, BLOCK, "cache_aware", balance_threshold=100)
    system = list(range(1, 13))
    first, second = (router.prompt_hashes(system + [i] * 5) for i in (20, 30))
    assert router.route(first, [0, 0]) == 0
    assert router.route(second, [20, 0]) == 0  # 3 system blocks expected on replica 0
    router.finished(0, first)
    router.finished(0, second)
    assert not router.inflight[0] and router.route(second, [20, 0]) == 1  # never stored: nothing held


def test_lora_affinity_without_a_prefix_hit():
    router = Router(4, BLOCK, "cache_aware", balance_threshold=10)
    hashes = router.prompt_hashes(list(range(9)))
    assert route_alone(router, hashes, [5, 0, 5, 5], lora_id=7) == 1
    assert route_alone(router, hashes, [5, 3, 0, 5], lora_id=7) == 1  # it served adapter 7
    assert route_alone(router, hashes, [5, 11, 0, 5], lora_id=7) == 2  # unless that breaks the bound
    assert router.lora_replicas[7] == {1, 2}
    assert route_alone(router, hashes, [5, 3, 1, 0], lora_id=7) == 2  # the least loaded of those that served it


def test_other_policies_ignore_the_cache():
    hashes = Router(2, BLOCK).prompt_hashes(list(range(9)))
    least = Router(3, BLOCK, "least_loaded")
    least.apply_events(0, stored(hashes))
    assert least.route(hashes, [10, 3, 5]) == 1
    rr = Router(3, BLOCK, "round_robin")
    assert [rr.route(hashes, [0, 9, 9]) for _ in range(4)] == [0, 1, 2, 0]
    dead = float("inf")
    assert [rr.route(hashes, [0, dead, 9]) for _ in range(3)] == [2, 0, 2]  # a dead replica is skipped
    cache = Router(2, BLOCK, "cache_aware")
    cache.apply_events(1, stored(hashes))
    assert cache.route(hashes, [5, dead]) == 0
    with pytest.raises(ValueError, match="router_policy"):
        Router(2, BLOCK, "random")


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31), st.integers(6, 20))
def test_events_replay_to_the_cached_hashes(seed, num_blocks):
    """Prompts over a few shared prefixes on a small pool (evicting), an occasional failed step and reset: replaying
    the recorded events gives exactly the pool's cached hashes, at every point."""
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, BLOCK)
    bm.events = []
    held, live = set(), []
    prefixes = [[rng.randrange(50) for _ in range(8)] for _ in range(3)]
    for _ in range(30):
        tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
        seq = Sequence("r", 0, tokens, SamplingParams(max_tokens=1), 1)
        if bm.allocate_slots(seq, len(tokens), bm.get_computed_blocks(seq)):
            live.append(seq)
            if rng.random() < 0.2:  # its step failed: what it was to compute is unhashed
                seq.num_computed_tokens = 0
                bm.forget_uncomputed(seq)
        if live and (rng.random() < 0.6 or bm.num_free_blocks < 4):
            bm.free_seq(live.pop(rng.randrange(len(live))))
        if not live and rng.random() < 0.1:
            assert bm.reset_prefix_cache()
        for event in bm.take_events():
            if isinstance(event, BlockStored):
                assert not held & set(event.block_hashes), "a hash stored twice"
                held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= held, "a hash removed that was not stored"
                held.difference_update(event.block_hashes)
            else:
                held.clear()
        assert held == set(bm.cached)
