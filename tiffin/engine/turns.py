"""Engines that share one device take their steps in turn (`StepTurns`): a chat model and an embedding model in
one service, say.

Two engines stepping at once on a CPU run twice the threads on the same cores: each step is slower than the two
in turn, and an embedding step of thousands of tokens holds up every chat token queued behind it. Turns go in
arrival order, so two busy engines alternate. An engine that yields (the embedding one) also keeps each of its
steps to `share` of the last step of an engine with work, at the speed its own steps measure, so that the other
engine's time per token grows by at most that share; with the device to itself it takes its whole budget. A
turn whose allowance cannot run the yielding engine's next prompt whole schedules nothing and saves the allowance
up for the next turn (and so on until the prompt fits): the other engine loses no time to a step that would
overrun its share, and the average share still holds."""

import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager


class StepTurns:
    def __init__(self, share: float = 0.5):
        self.share = share
        self._turns = threading.Condition()  # guards everything below
        self._queue: deque[object] = deque()
        self._yields: set[object] = set()
        self._busy: dict[object, float] = {}  # an engine with work -> seconds of its last step
        self._speed: dict[object, float] = {}  # a yielding engine -> tokens per second of its recent steps
        self._saved: dict[object, float] = {}  # a yielding engine -> tokens its turns saved up, running nothing
        self._others_steps = 0  # steps the engines that do not yield have run
        self._granted_at: dict[object, int] = {}  # a yielding engine -> `_others_steps` at its last allowance

    def join(self, engine: object, yields: bool = False) -> None:
        if yields:
            self._yields.add(engine)

    def budget(self, engine: object, full: int) -> int:
        """Tokens `engine`'s next step may compute: `full`, or for a yielding engine beside one with work, what its
        speed computes in `share` of that engine's last step (once per step of the others), plus what its turns
        saved up (at least 1)."""
        with self._turns:
            others = [seconds for e, seconds in self._busy.items() if e is not engine]
            speed = self._speed.get(engine)
            if engine not in self._yields or not others or speed is None:
                self._saved.pop(engine, None)
                return full
            allowance = self._saved.get(engine, 0)
            if self._granted_at.get(engine) != self._others_steps:
                self._granted_at[engine] = self._others_steps
                allowance = min(full, allowance + speed * self.share * max(others))
            self._saved[engine] = allowance
            return max(1, int(allowance))

    @contextmanager
    def turn(self, engine: object) -> Iterator[None]:
        """Wait for `engine`'s turn, then hold the device while the block runs (one step)."""
        with self._turns:
            self._queue.append(engine)
            self._turns.wait_for(lambda: self._queue[0] is engine)
        try:
            yield
        finally:
            with self._turns:
                self._queue.popleft()
                self._turns.notify_all()

    def stepped(self, engine: object, seconds: float, tokens: int, busy: bool) -> None:
        """After a step of `tokens` tokens that took `seconds`: whether `engine` still has work."""
        with self._turns:
            if tokens:  # what a turn that ran something did not use is not saved: no burst later
                self._saved.pop(engine, None)
            if not busy:
                self._busy.pop(engine, None)
            elif tokens:
                self._busy[engine] = seconds
            if engine in self._yields and tokens and seconds > 0:
                speed = tokens / seconds
                self._speed[engine] = speed if engine not in self._speed else 0.7 * self._speed[engine] + 0.3 * speed
            elif engine not in self._yields and tokens:
                self._others_steps += 1
            self._turns.notify_all()

    @contextmanager
    def step(self, engine) -> Iterator[None]:
        """One step of `engine` (an `LLMEngine`) in its turn, its scheduler held to the tokens `budget` gives it. A
        held step that ran nothing waits for another engine's step (or a second) before the next turn."""
        scheduler = engine.scheduler
        scheduler.step_budget = self.budget(engine, scheduler.max_num_batched_tokens)
        with self.turn(engine):
            start = time.perf_counter()
            yield
            seconds = time.perf_counter() - start
        self.stepped(engine, seconds, engine.last_step_tokens, engine.has_unfinished_requests())
        with self._turns:
            if not engine.last_step_tokens and engine in self._saved:
                seen = self._others_steps
                idle = lambda: all(e is engine for e in self._busy)
                self._turns.wait_for(lambda: self._others_steps != seen or idle(), timeout=1.0)
