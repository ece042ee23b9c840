"""The xgrammar backend of structured outputs: compiled grammars, per-sequence matchers, the step's bitmask.

Compiling a grammar against the vocabulary takes milliseconds to seconds, in C++ that cannot be interrupted
(and that releases the GIL), so compiles run on a pool of worker threads while the engine steps and servers
answer; a sequence waits for its grammar before its first step. Each sequence owns a matcher (n > 1 samples
diverge), advanced with every token it samples.

Invariants (`GrammarBackend`):
- A compile never runs on its caller's thread; at most `workers` run at once, so one slow compile leaves the
  others room, and at most MAX_PENDING are queued or running: more are refused (QueueFull), or wait for room
  (`wait_for_room`).
- A queued compile that every caller who asked to wait for it gave up on (`release`) never starts; a running
  one finishes and is cached.
- Compiled grammars are cached by `StructuredOutputsParams.key`: at most `cache_size` of them and `cache_bytes`
  bytes (least recently used first out); a grammar larger than `cache_bytes`, or one that allows no output,
  fails its compile with a ValueError saying so. xgrammar's own unbounded cache is off."""

import functools
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from tiffin.engine.errors import QueueFull
from tiffin.engine.structured.params import StructuredOutputsParams
from tiffin.engine.structured.utf8 import INVALID, START, Utf8Table

CACHE_SIZE = 256  # compiled grammars kept, however small
CACHE_BYTES = 256 << 20  # EngineConfig.grammar_cache_bytes' default
WORKERS = 4  # compiles at once; each takes one core while it runs
MAX_PENDING = 64  # compiles queued or running


class Grammar(NamedTuple):
    """What a compile gives: xgrammar's compiled grammar and the vocabulary's UTF-8 table."""

    compiled: Any  # xgrammar.CompiledGrammar, imported lazily
    utf8: Utf8Table


@dataclass
class _Entry:
    future: Future
    waiters: int = 0  # callers of compile(waiter=True) that have not released it
    held: bool = False  # a caller that never releases (the engine) uses it: never cancelled
    nbytes: int = 0  # once compiled


class GrammarBackend:
    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_token_ids: set[int],
        cache_size: int = CACHE_SIZE,
        cache_bytes: int = CACHE_BYTES,
        workers: int = WORKERS,
    ):

        self.vocab_size = vocab_size
        self.cache_size, self.cache_bytes = cache_size, cache_bytes
        self.cached_bytes = 0  # of the compiled grammars in the cache
        self._cache: OrderedDict[bytes, _Entry] = OrderedDict()
        self._pending = 0
        # Reentrant: a future finished (or cancelled) while compile() or release() holds it runs _compiled at once.
        self._lock = threading.RLock()
        self._room = threading.Condition(self._lock)  # notified as compiles end
        self._workers = ThreadPoolExecutor(workers, thread_name_prefix="tiffin-grammar")
        # The tokenizer's vocabulary is read once, on a worker too (a second or so for 150k tokens).
        self._vocabulary = self._workers.submit(self._read_vocabulary, tokenizer, sorted(stop_token_ids))

    def _read_vocabulary(self, tokenizer, stop_token_ids: list[int]) -> tuple[Any, Utf8Table]:
        import xgrammar

        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=stop_token_ids
        )
        compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return compiler, Utf8Table(info.decoded_vocab, self.vocab_size)

    def compile(self, params: StructuredOutputsParams, waiter: bool = False) -> Future:
        """A future of the compiled grammar, cached or newly queued; safe from any thread. A `waiter` calls
        `release` once it stops waiting; any other caller keeps the compile from being cancelled. QueueFull if
        MAX_PENDING compiles are queued or running already."""
        with self._lock:
            entry = self._cache.get(params.key)
            if entry is None:
                if self._pending >= MAX_PENDING:
                    raise QueueFull(f"{self._pending} structured-outputs grammars are compiling; retry later")
                entry = _Entry(self._workers.submit(self._compile, params.xgrammar_grammar))
                self._pending += 1
                self._cache[params.key] = entry
                entry.future.add_done_callback(functools.partial(self._compiled, params.key, entry))
                self._evict()
            else:
                self._cache.move_to_end(params.key)
            entry.waiters += waiter
            entry.held |= not waiter
            return entry.future

    def release(self, key: bytes, future: Future) -> None:
        """A waiter of `compile(waiter=True)` stopped waiting: a compile nobody waits for any more that has not
        started is cancelled and forgotten."""
        with self._lock:
            entry = self._cache.get(key)
            if entry is None or entry.future is not future:
                return
            entry.waiters -= 1
            if entry.waiters == 0 and not entry.held and future.cancel():
                del self._cache[key]

    def wait_for_room(self) -> bool:
        """Block until fewer than MAX_PENDING compiles are queued or running (a caller that cannot be refused, the
        offline `LLM`, waits where a server answers 429); False if there was room already."""
        with self._room:
            if self._pending < MAX_PENDING:
                return False
            self._room.wait_for(lambda: self._pending < MAX_PENDING)
            return True

    def _compile(self, grammar):
        import xgrammar

        compiler, utf8 = self._vocabulary.result()
        compiled = compiler.compile_grammar(grammar)
        size = compiled.memory_size_bytes
        if size > self.cache_bytes:
            del compiled  # the exception's traceback, cached with it, must not keep the grammar alive
            raise ValueError(
                f"the grammar compiles to {size} bytes, more than grammar_cache_bytes={self.cache_bytes} allows"
            )
        bitmask = xgrammar.allocate_token_bitmask(1, self.vocab_size)
        xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
        if not bitmask.any():  # not even a stop token: every output would be rejected at its first token
            raise ValueError("the grammar allows no output: no token can begin it")
        return Grammar(compiled, utf8)

    def _compiled(self, key: bytes, entry: _Entry, future: Future) -> None:
        with self._lock:
            self._pending -= 1
            self._room.notify_all()
            if future.cancelled() or future.exception() is not None or self._cache.get(key) is not entry:
                return
            entry.nbytes = future.result().compiled.memory_size_bytes
            self.cached_bytes += entry.nbytes
            self._evict()

    def _evict(self) -> None:
        """Least recently used first: any entry while there are more than cache_size (a compile still running
        goes on for its waiters), then compiled ones while they take more than cache_bytes."""
        for key, entry in list(self._cache.items()):
            if len(self._cache) > self.cache_size or (self.cached_bytes > self.cache_bytes and entry.future.done()):
                del self._cache[key]
                self.cached_bytes -= entry.nbytes
            elif self.cached_bytes <= self.cache_bytes:
                break


def compile_error(e: BaseException) -> str:
    """Why a grammar did not compile, as a request's error says it."""
    return f"grammar compilation failed: {e if isinstance(e, ValueError) else f'{type(e).__name__}: {e}'}"


def fill_bitmask(seqs: Sequence, vocab_size: int) -> Future | None:
    """Start filling the step's token bitmask: row i allows the tokens `seqs[i]`'s grammar accepts next (all
    tokens for an unconstrained row). xgrammar's batch matcher fills it on a worker thread without the GIL, so
    this overlaps the forward pass. A future of (bitmask, constrained rows); None when no row is constrained (a
    grammar that has not started, `GrammarState.start` None, constrains nothing).

    A row `ahead` of its sequence (speculative decoding: it verifies a proposal after `ahead` others, which its
    grammar has taken, `GrammarState.accepted_prefix`) is filled after the first row, its matcher stepped
    through the proposals before it and then rolled back."""
    rows = [i for i, s in enumerate(seqs) if s.grammar is not None and s.grammar.start is not None]
    if not rows:
        return None
    states = []
    for i in rows:
        s = seqs[i]
        if not s.ahead:  # a no-op unless preemption dropped the matcher
            s.grammar.sync(s.output_token_ids)
            states.append(s.grammar.utf8_state)
        else:
            states.append(s.grammar.utf8.next_state[states[-1]][seqs[i - 1].proposed])
    first = [i for i in rows if not seqs[i].ahead]
    matchers = [seqs[i].grammar.matcher for i in first]
    utf8 = seqs[rows[0]].grammar.utf8  # one vocabulary, one table

    def fill():
        import xgrammar

        bitmask = xgrammar.allocate_token_bitmask(len(seqs), vocab_size)
        _batch_matcher().batch_fill_next_token_bitmask(matchers, bitmask, indices=first)
        for i in rows:
            ahead, matcher = seqs[i].ahead, seqs[i].grammar.matcher
            if ahead:
                matcher.accept_token(seqs[i - 1].proposed)
                if not matcher.is_terminated():  # else no token follows: the row is never read
                    matcher.fill_next_token_bitmask(bitmask, i)
                if i + 1 == len(seqs) or seqs[i + 1].ahead <= ahead:  # the sequence's last row
                    matcher.rollback(ahead)
        utf8.mask(bitmask, rows, states)
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
    """One sequence's position in its grammar, and in a UTF-8 character (tiffin.engine.structured.utf8). The
    matcher is built from the sequence's output tokens when first needed, so that a sequence can drop it
    (preemption) and get it back in the state its tokens imply."""

    def __init__(self, compiled: Future, timeout: float | None = None):
        """`timeout`: seconds the compile may still take (grammar_compile_timeout) before `error` says so."""
        self.compiled = compiled
        self.timeout = timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._matcher = None
        # the output token the grammar starts at; None: not yet (a reasoning model's thinking, which it leaves free)
        self.start: int | None = 0
        self.num_accepted = 0  # output tokens the matcher has consumed, from `start`
        self.utf8: Utf8Table | None = None
        self.utf8_state = START

    @property
    def ready(self) -> bool:
        return self.compiled.done()

    @property
    def error(self) -> str | None:
        """Why the grammar could not be compiled, once it is known, or its compile is past the deadline."""
        if not self.compiled.done():
            late = self._deadline is not None and time.monotonic() > self._deadline
            return f"the grammar did not compile within grammar_compile_timeout={self.timeout:g} s" if late else None
        e = self.compiled.exception()  # never cancelled: the engine holds what it compiles
        return None if e is None else compile_error(e)

    @property
    def matcher(self):
        return self._matcher

    def sync(self, output_token_ids: list[int]) -> bool:
        """Bring the matcher up to `output_token_ids` from `start` (building it if needed); False if the grammar
        rejects one of them."""
        if self.start is None:
            return True
        if self._matcher is None:
            import xgrammar

            grammar = self.compiled.result()
            self._matcher, self.utf8 = xgrammar.GrammarMatcher(grammar.compiled), grammar.utf8
            self.num_accepted, self.utf8_state = 0, START
        for token in output_token_ids[self.start + self.num_accepted :]:
            utf8_state = self.utf8.next_state[self.utf8_state][token]
            if utf8_state == INVALID or not self._matcher.accept_token(token):
                return False
            self.num_accepted, self.utf8_state = self.num_accepted + 1, utf8_state
        return True

    def accepted_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` the grammar takes after the sequence's own (the matcher synced to them), up to
        one that ends it; the matcher is left where it was."""
        n, state = 0, self.utf8_state
        for token in tokens:
            state = self.utf8.next_state[state][token]
            if self._matcher.is_terminated() or state == INVALID or not self._matcher.accept_token(token):
                break
            n += 1
        self._matcher.rollback(n)
        return n

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
