"""Two KV cache groups for a model whose layers mix sliding-window attention with global attention (Gemma 2/3), as
vLLM's hybrid KV cache manager keeps them: the global layers' blocks (`BlockManager`, `Sequence.block_table`) and
the windowed layers' (`SlidingWindowBlocks`, `Sequence.window_table`), each group a pool of its own whose blocks
hold only its layers' KV (the worker sizes and stores them: `worker.kv_groups`). A sequence then holds KV for its
whole context in the global layers and for about a window in the windowed ones.

Invariants:
- A sequence's two tables cover the same blocks of its positions. The window table's entries wholly before the
  window of the sequence's next query are the null block (one past the pool, which the window's mask never reads):
  a query at position p reads keys p - window + 1 ... p, so when a step starts at position c the blocks wholly
  before c - window + 1 go back to the pool (at allocation, as vLLM frees them); hashed ones stay findable.
- Both groups take a step's blocks or neither does: the window pool's room is checked first, which changes
  nothing but giving back the blocks left behind the window (never read again).
- Prefix caching: both groups hash their full blocks by the one chain (`block_hashes`). A hit of n blocks needs the
  global group's n blocks and the window group's blocks that the query at n * block_size reads: the hit is the
  longest n with both (vLLM's rule for sliding-window hits); the window table holds the null block before them.
- No host tier and no swap region (the runner keeps one group where either is on, `worker.kv_groups`).
"""

from tiffin.engine.core.block_manager import BlockManager
from tiffin.engine.core.sequence import Sequence


class SlidingWindowBlocks(BlockManager):
    """The windowed layers' pool: a `BlockManager` over `Sequence.window_table`, giving back what leaves the window."""

    table_attr, hashed_attr = "window_table", "num_window_hashed_blocks"

    def __init__(self, num_blocks: int, block_size: int, window: int, enable_prefix_caching: bool):
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.window = window
        self.null_block = num_blocks  # the pool's dummy block (`KVCacheSpec.allocate`)

    def first_needed(self, position: int) -> int:
        """The first block that the query at `position` (and every later one) reads."""
        return max(position - self.window + 1, 0) // self.block_size

    def longest_hit(self, seq: Sequence, num_blocks: int) -> int:
        """The most of `seq`'s first `num_blocks` full blocks (a hit in the global group) that a hit may cover: those
        whose blocks the query after them reads are all cached here."""
        run = best = 0
        for i, block_hash in enumerate(self._hashes(seq, num_blocks)):
            run = run + 1 if block_hash in self.cached else 0
            if run >= i + 1 - self.first_needed((i + 1) * self.block_size):
                best = i + 1
        return best

    def has_room(self, seq: Sequence, num_new_tokens: int, num_hits: int) -> bool:
        """Whether `allocate` of the same arguments succeeds; first gives back `seq`'s blocks behind its window."""
        table, (hits, num_blocks, start) = self.table(seq), self._plan(seq, num_new_tokens, num_hits)
        behind = [block for block in table[:start] if block != self.null_block]
        if behind:
            self._release(behind)  # oldest first: the least recently used of the freed hashed blocks
            table[:start] = [self.null_block] * start
        return self._has_room(hits, num_blocks - max(len(table), start))

    def allocate(self, seq: Sequence, num_new_tokens: int, num_hits: int) -> None:
        """As `allocate_slots` for a step of `num_new_tokens` after `seq`'s computed tokens, or after its first
        `num_hits` blocks (a prefix hit, `longest_hit`'s), once `has_room` said yes."""
        hits, num_blocks, start = self._plan(seq, num_new_tokens, num_hits)
        table = self.table(seq)
        if not table:
            table.extend([self.null_block] * start)
        self._extend(seq, hits, {}, num_blocks)
        if self.enable_prefix_caching:
            num_tokens = max(seq.num_computed_tokens, num_hits * self.block_size) + num_new_tokens
            self._cache_full_blocks(seq, min(num_tokens, seq.num_tokens) // self.block_size)

    def _plan(self, seq: Sequence, num_new_tokens: int, num_hits: int) -> tuple[list[int | None], int, int]:
        """(the hits at their places, None elsewhere; the table's length after the step; its first block needed)."""
        computed = max(seq.num_computed_tokens, num_hits * self.block_size)
        start = self.first_needed(computed)
        hits = []
        if num_hits and not self.table(seq):  # admitted on a hit: the blocks it reads are cached (`longest_hit`)
            hits = [None] * start + [self.cached[h] for h in self._hashes(seq, num_hits)[start:]]
        return hits, self.blocks_needed(computed + num_new_tokens), start


class HybridBlockManager(BlockManager):
    """The global group's pool (this manager's own) and the window group's (`window`): every call on a sequence's
    blocks applies to both. Capacity (`num_blocks`, `num_free_blocks`, the prefix-cache counters) is the global
    group's, which bounds a sequence's context."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, window: int, window_blocks: int):
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.window = SlidingWindowBlocks(window_blocks, block_size, window, enable_prefix_caching)

    def get_computed_blocks(self, seq: Sequence) -> list[int | None]:
        hits = super().get_computed_blocks(seq)
        return hits[: self.window.longest_hit(seq, len(hits))] if hits else hits

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int | None] = ()) -> bool:
        if not self.window.has_room(seq, num_new_tokens, len(computed_blocks)):
            return False
        if not super().allocate_slots(seq, num_new_tokens, computed_blocks):
            return False
        self.window.allocate(seq, num_new_tokens, len(computed_blocks))
        return True

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        super().trim(seq, num_tokens)
        self.window.trim(seq, num_tokens)

    def free_seq(self, seq: Sequence) -> None:
        super().free_seq(seq)
        self.window.free_seq(seq)

    def forget_uncomputed(self, seq: Sequence) -> None:
        super().forget_uncomputed(seq)
        self.window.forget_uncomputed(seq)

    def reset_prefix_cache(self) -> bool:
        return super().reset_prefix_cache() and self.window.reset_prefix_cache()

    def check_invariants(self, seqs) -> None:
        seqs = list(seqs)
        super().check_invariants(seqs)
        self.window.check_invariants(seqs)
        assert all(len(s.block_table) == len(s.window_table) for s in seqs), "a sequence's two tables differ in length"


def new_block_manager(
    num_blocks: int,
    block_size: int,
    enable_prefix_caching: bool,
    host_blocks: tuple[int, int],
    window: tuple[int, int] | None,
) -> BlockManager:
    """The engine's block manager: one pool with `host_blocks` (tier, swap), or with `window` (the window, the window
    group's blocks: `worker.kv_groups`) two groups."""
    if window is None:
        return BlockManager(num_blocks, block_size, enable_prefix_caching, *host_blocks)
    return HybridBlockManager(num_blocks, block_size, enable_prefix_caching, *window)
