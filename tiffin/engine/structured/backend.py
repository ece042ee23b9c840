"""The xgrammar backend of structured outputs: compiled grammars, per-sequence matchers, the step's bitmask.

Compiling a grammar against the vocabulary takes milliseconds to seconds, so it runs on a worker thread while
the engine keeps stepping; a sequence waits for its grammar before its first step. Compiled grammars are
cached by `StructuredOutputsParams.key` (LRU, bounded); xgrammar's own unbounded cache is off. Each sequence
owns a matcher (n > 1 samples diverge), advanced with every token it samples."""

import functools
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from tiffin.engine.structured.params import StructuredOutputsParams

CACHE_SIZE = 256  # compiled grammars kept


class GrammarBackend:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int], cache_size: int = CACHE_SIZE):
        import xgrammar

        self.cache_size = cache_size
        self._cache: OrderedDict[bytes, Future] = OrderedDict()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="tiffin-grammar")
        # The tokenizer's vocabulary is read once, on the worker too (a second or so for 150k tokens).
        self._compiler = self._worker.submit(
            lambda: xgrammar.GrammarCompiler(
                xgrammar.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
                ),
                max_threads=1,
                cache_enabled=False,
            )
        )

    def compile(self, params: StructuredOutputsParams) -> Future:
        """A future of the compiled grammar; the engine thread is the only caller."""
        future = self._cache.get(params.key)
        if future is None:
            future = self._worker.submit(lambda: self._compiler.result().compile_grammar(params.xgrammar_grammar))
            self._cache[params.key] = future
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(params.key)
        return future


def fill_bitmask(seqs: Sequence, vocab_size: int) -> Future | None:
    """Start filling the step's token bitmask: row i allows the tokens `seqs[i]`'s grammar accepts next (all
    tokens for an unconstrained row). xgrammar's batch matcher fills it on a worker thread without the GIL, so
    this overlaps the forward pass. A future of (bitmask, constrained rows); None when no row is constrained."""
    rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
    if not rows:
        return None
    for i in rows:
        seqs[i].grammar.sync(seqs[i].output_token_ids)  # a no-op unless preemption dropped the matcher
    matchers = [seqs[i].grammar.matcher for i in rows]

    def fill():
        import xgrammar

        bitmask = xgrammar.allocate_token_bitmask(len(seqs), vocab_size)
        _batch_matcher().batch_fill_next_token_bitmask(matchers, bitmask, indices=rows)
        return bitmask, rows

    return _fill_worker().submit(fill)


def apply_bitmask(logits: torch.Tensor, filled: Future) -> None:
    """Mask, in place, the constrained rows' logits with `fill_bitmask`'s result, in one kernel."""
    import xgrammar

    bitmask, rows = filled.result()
    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)


@functools.cache
def _batch_matcher():
    import xgrammar

    return xgrammar.BatchGrammarMatcher(max_threads=1)


@functools.cache
def _fill_worker() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(1, thread_name_prefix="tiffin-bitmask")


class GrammarState:
    """One sequence's position in its grammar. The matcher is built from the sequence's output tokens when
    first needed, so that a sequence can drop it (preemption) and get it back in the state its tokens imply."""

    def __init__(self, compiled: Future):
        self.compiled = compiled
        self._matcher = None
        self.num_accepted = 0  # output tokens the matcher has consumed

    @property
    def ready(self) -> bool:
        return self.compiled.done()

    @property
    def error(self) -> str | None:
        """Why the grammar could not be compiled, once it is known."""
        if not self.compiled.done() or self.compiled.exception() is None:
            return None
        e = self.compiled.exception()
        return f"grammar compilation failed: {type(e).__name__}: {e}"

    @property
    def matcher(self):
        return self._matcher

    def sync(self, output_token_ids: list[int]) -> bool:
        """Bring the matcher up to `output_token_ids` (building it if needed); False if the grammar rejects
        one of them."""
        if self._matcher is None:
            import xgrammar

            self._matcher = xgrammar.GrammarMatcher(self.compiled.result())
            self.num_accepted = 0
        for token in output_token_ids[self.num_accepted :]:
            if not self._matcher.accept_token(token):
                return False
            self.num_accepted += 1
        return True

    def verdict(self, output_token_ids: list[int]) -> tuple[str, str | None] | None:
        """After a sampled token: ("error", why) if the grammar rejects it, ("stop", None) once the grammar has
        ended, else None (go on)."""
        if not self.sync(output_token_ids):
            return "error", f"the grammar rejected token {output_token_ids[-1]}"
        return ("stop", None) if self.terminated else None

    @property
    def terminated(self) -> bool:
        return self._matcher is not None and self._matcher.is_terminated()

    def drop(self) -> None:
        """Free the matcher; `sync` rebuilds it from the tokens."""
        self._matcher = None
