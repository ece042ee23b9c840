"""The engine's sleep mode and weight reload (vLLM's `sleep` / `wake_up` / `is_sleeping`, SGLang's
`update_weights_from_disk`), on every tensor-parallel rank; tiffin.engine.worker.sleep frees and refills the memory.

- `sleep(level)` needs an idle engine, as vLLM's does (EngineBusy names the requests in flight otherwise; the
  async engine finishes them first). Level 1 frees the KV cache (and the CUDA graphs), keeping the weights (on CUDA
  in host memory); level 2 drops the weights too, read again from the checkpoint on `wake_up`. While asleep the
  engine takes no request (EngineAsleep). Sleeping empties the prefix cache.
- `update_weights(path)`: a checkpoint with the served one's architecture, config and tensors (names, shapes and
  dtypes, from the headers: `checkpoint_signature`), checked before anything is touched: a mismatch raises
  ValueError naming the differences while the old weights serve on. It needs an idle engine unless
  `abort_in_flight` (the async engine finishes the requests in flight first instead). The prefix cache is emptied;
  LoRA adapters are kept: they apply to any base of these shapes. A level-2 wake reads the new checkpoint.
- `reset_prefix_cache()` empties the prefix cache alone (vLLM's), on an idle engine (the async one waits for it).
- A draft model (speculative decoding) is not covered: both refuse it by name.
"""

import asyncio
import dataclasses
import logging
import time
from collections import deque
from pathlib import Path

from tiffin.engine.errors import EngineAsleep, EngineBusy
from tiffin.engine.models.config import resolve_dtype
from tiffin.engine.models.loader import checkpoint_signature, get_model_config
from tiffin.engine.worker.sleep import on_every_rank

logger = logging.getLogger(__name__)
SLEEP_LEVELS = (1, 2)
MAX_NAMED = 4  # differences a refused checkpoint's error names
ASLEEP_POLL = 0.05  # seconds between looks at a sleeping engine by a request waiting for it to wake


class SleepMode:
    """LLMEngine's sleep and reload; `sleep_level` 0 while awake."""

    sleep_level = 0

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1) and the weights too (level 2); deeper than the engine sleeps already, it
        wakes first; as deep or shallower, nothing changes."""
        if level not in SLEEP_LEVELS:
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        self._check_reloadable("sleep")
        if level <= self.sleep_level:
            return
        self._check_idle("sleep")
        self.wake_up()
        on_every_rank(self.model_runner, "sleep", level)
        self.block_manager.reset_prefix_cache()
        self.sleep_level = level

    def wake_up(self) -> None:
        """Take back what `sleep` freed (a no-op while awake); the engine serves again as before it slept."""
        if self.sleep_level:
            on_every_rank(self.model_runner, "wake_up")
            self.sleep_level = 0

    def is_sleeping(self) -> bool:
        return self.sleep_level > 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (vLLM's name), as sleeping and new weights do: False, changing nothing,
        while requests hold blocks."""
        return self.block_manager.reset_prefix_cache()

    def check_awake(self) -> None:
        if self.sleep_level:
            raise EngineAsleep(f"the engine is asleep (sleep level {self.sleep_level}): wake_up first")

    def update_weights(self, path: str | Path, abort_in_flight: bool = False) -> None:
        """Serve the weights of the checkpoint at `path` (a directory or a GGUF file), checked against the served
        one first; `abort_in_flight` aborts the requests in flight, which otherwise refuse it (EngineBusy)."""
        self._check_reloadable("update_weights")
        self.check_awake()
        path = str(path)
        signature = self.check_checkpoint(path)
        if abort_in_flight:
            self.abort_request(list(self.requests))
        self._check_idle("update_weights")
        on_every_rank(self.model_runner, "load_weights", path)
        self.weights_signature = signature
        self.block_manager.reset_prefix_cache()

    def check_checkpoint(self, path: str) -> dict:
        """The signature of the checkpoint at `path`; ValueError naming how it differs from the served one."""
        config = self.config
        try:
            model_config = get_model_config(path, config.task, config.pooling_type, config.quantization)
            signature = checkpoint_signature(path)
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"cannot read the checkpoint at {path}: {type(e).__name__}: {e}") from None
        served = self.model_config
        model_config.dtype = resolve_dtype(config.dtype, model_config.dtype, config.torch_device)
        differences = [
            f"{f.name}: {getattr(model_config, f.name)!r}, served {getattr(served, f.name)!r}"
            for f in dataclasses.fields(served)
            if getattr(model_config, f.name) != getattr(served, f.name)
        ]
        old = self.weights_signature
        differences += [f"{name}: missing" for name in old.keys() - signature.keys()]
        differences += [f"{name}: not in the served model" for name in signature.keys() - old.keys()]
        differences += [
            f"{name}: {signature[name]}, served {old[name]}"
            for name in old.keys() & signature.keys()
            if signature[name] != old[name]
        ]
        if differences:
            named = "; ".join(sorted(differences)[:MAX_NAMED])
            more = f" (and {len(differences) - MAX_NAMED} more)" if len(differences) > MAX_NAMED else ""
            raise ValueError(f"checkpoint at {path} does not match the served model: {named}{more}")
        return signature

    def _check_idle(self, what: str) -> None:
        if self.requests:
            n = len(self.requests)
            raise EngineBusy(f"{what} needs an idle engine: {n} request{'s are' if n > 1 else ' is'} in flight")

    def _check_reloadable(self, what: str) -> None:
        spec = self.config.speculative_config
        if spec is not None and spec.method == "draft_model":
            raise ValueError(f"{what} does not cover a draft model (speculative_config method draft_model) yet")


class AsyncSleepMode:
    """AsyncLLMEngine's side: sleep, wake and reload run on the engine thread between steps, once the requests in
    flight finished (`update_weights` may abort them instead); requests arriving meanwhile are held, then let in.
    A request arriving while the engine sleeps by `sleep` waits up to `asleep_request_wait` seconds for `wake_up`,
    then is refused (EngineAsleep); one arriving while it sleeps for being idle (`idle_sleep_seconds`) wakes it.
    It holds `engine`, `_inbox`, `_active`, `_lock`, `_dead`, `_post` and `_engine_call`."""

    def _init_sleep_mode(self) -> None:
        self._exclusives: deque[tuple] = deque()  # sleep / wake / reload calls waiting for the engine to idle
        self._held: deque[tuple] = deque()  # adds that arrived after them
        self._idle_slept = False  # asleep for being idle: the next request wakes it

    async def sleep(self, level: int = 1) -> None:
        """`LLMEngine.sleep` once the requests in flight finished."""
        await self._exclusive("sleep", (level,))

    async def wake_up(self) -> None:
        await self._exclusive("wake_up", ())

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    async def reset_prefix_cache(self) -> bool:
        """`LLMEngine.reset_prefix_cache` once the requests in flight finished (so it succeeds)."""
        return await self._exclusive("reset_prefix_cache", ())

    async def update_weights(self, path: str, abort_in_flight: bool = False) -> None:
        """`LLMEngine.update_weights` once the requests in flight finished (`abort_in_flight`: aborted at once). The
        checkpoint is checked first, off the engine thread: a mismatch raises ValueError holding nothing up."""
        self.engine.check_awake()
        await asyncio.to_thread(self.engine.check_checkpoint, str(path))
        await self._exclusive("update_weights", (str(path),), abort_in_flight)

    async def _exclusive(self, method: str, args: tuple, abort: bool = False):
        self._check_running()
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._post(("exclusive", method, args, loop, done, abort))
        return await done

    async def _await_awake(self, deadline: float) -> None:
        """While the engine sleeps by `sleep`, wait for `wake_up` until `deadline` (time.monotonic), then refuse."""
        while self.engine.is_sleeping() and not self._idle_slept:
            if time.monotonic() >= deadline:
                wait = self.engine.config.asleep_request_wait
                raise EngineAsleep(
                    f"the engine is asleep (sleep level {self.engine.sleep_level}) and was not woken within "
                    f"asleep_request_wait={wait:g} s: wake_up first"
                )
            await asyncio.sleep(ASLEEP_POLL)

    # --- engine thread ---

    def _queue_exclusive(self, op: tuple) -> None:
        """Hold later adds until `op` ran; with its abort flag, abort the requests in flight now."""
        if op[5]:
            for request_id in list(self._active):
                self._abort(request_id)
        self._exclusives.append(op)

    def _run_exclusive(self) -> bool:
        """Idle: run the first waiting sleep / wake / reload call, then let the adds it held in; False if none."""
        if not self._exclusives or self.engine.has_unfinished_requests():
            return False
        with self._lock:
            _, method, args, loop, done, _ = self._exclusives.popleft()
            self._idle_slept = False
            self._engine_call(method, args, loop, done)
            if not self._exclusives:
                self._inbox.extendleft(reversed([op for op in self._held if not op[8].done()]))
                self._held.clear()
            self._publish_stats()
        return True

    def _idle_timeout(self) -> float | None:
        """How long the engine may idle before it sleeps by itself (None: without end)."""
        return None if self.engine.is_sleeping() else self.engine.config.idle_sleep_seconds

    def _sleep_when_idle(self) -> None:
        """Idle for `idle_sleep_seconds`: sleep. One that fails leaves the engine in no known state: dead."""
        with self._lock:
            if self._inbox or self.engine.has_unfinished_requests() or self.dead:  # work arrived as the wait ended
                return
            try:
                self.engine.sleep(self.engine.config.idle_sleep_level)
            except Exception as e:
                logger.exception("idle sleep failed")
                self._dead = f"idle sleep failed: {type(e).__name__}: {e}"
                return
            self._idle_slept = True
            self._publish_stats()

    def _wake_for_request(self) -> None:
        """Before an add: an engine asleep for being idle wakes (raising, it stays so: the next add tries again)."""
        if self._idle_slept:
            self.engine.wake_up()
            self._idle_slept = False
