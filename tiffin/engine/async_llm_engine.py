"""The serving engine: `LLMEngine.step()` in a background thread, one async stream of outputs per request.

The LLMEngine is not thread-safe, so only the engine thread touches it: callers post `add` / `abort` to a
thread-safe inbox that the thread drains between steps, and the thread hands outputs back to each request's
asyncio loop with `call_soon_threadsafe`. Torch releases the GIL inside kernels, so the event loop keeps
serving HTTP while a step runs.

Prompts are tokenized in a worker thread before they reach the inbox, so a long prompt never stalls a step; chat
templates render on threads of their own (`render_chat`), each within its time limit; a structured-outputs
grammar is compiled (`GrammarBackend`'s threads) before its request reaches the inbox, so the engine never waits
on one, and a grammar that fails or misses its deadline is refused like any invalid request. A
request the engine fails ends its stream with EngineError while the others go on; an engine that cannot run
at all (EngineDeadError) fails every request, in flight or new, and reports `healthy` False; so does, until it
ends, a step that outlasts `engine_stall_timeout` (EngineStalled; tiffin.engine.watchdog).

Outputs are cumulative and safe to show: a text tail that could still become a (removed) stop string is held
back until it resolves, so each output's text extends the previous one and deltas are plain suffixes.
"""

import asyncio
import functools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass

from tiffin.engine import tokenize_pool
from tiffin.engine.async_pooling import AsyncPooling
from tiffin.engine.config import EngineConfig
from tiffin.engine.data_parallel import make_engine
from tiffin.engine.errors import EngineAsleep, EngineError, EngineStalled, ParamError
from tiffin.engine.input_processor import PromptType, TokenizedPrompt
from tiffin.engine.llm_engine import LLMEngine
from tiffin.engine.lora.request import LoRARequest
from tiffin.engine.outputs import EngineStats, RequestOutput
from tiffin.engine.pooling_params import PoolingParams
from tiffin.engine.request_stream import RequestStream
from tiffin.engine.sampling_params import SamplingParams
from tiffin.engine.sleep_mode import AsyncSleepMode
from tiffin.engine.structured.backend import compile_error
from tiffin.engine.structured.params import StructuredOutputsParams
from tiffin.engine.tokenize_pool import TokenizePool
from tiffin.engine.turns import StepTurns
from tiffin.engine.watchdog import StallHandling

logger = logging.getLogger(__name__)
# Threads that render chat templates, apart from those that tokenize: a render runs up to chat_template_timeout.
# Renders are Python, taking turns on the GIL, so more threads add no speed; they let more slow renders reach their
# deadlines together instead of queueing behind each other.
CHAT_TEMPLATE_THREADS = 8


@dataclass
class _Active:
    stream: RequestStream
    loop: asyncio.AbstractEventLoop


class AsyncLLMEngine(AsyncPooling, AsyncSleepMode, StallHandling):
    """`await add_request(...)` or `async for out in generate(...)`; `stats()` for monitoring. `on_stats`
    is called in the engine thread with `LLMEngine.stats()` after every step and every inbox batch; `on_step_age`
    with the seconds the step in progress has run (0 when idle) about every second, in the watchdog's thread."""

    def __init__(
        self,
        engine: LLMEngine,
        on_stats: Callable[[EngineStats], None] | None = None,
        turns: StepTurns | None = None,
        yields: bool = False,
        on_step_age: Callable[[float], None] | None = None,
    ):
        """`turns`: shared with the other engines on this device, which then step in turn; `yields`: this engine
        holds its steps short while another has work (an embedding model beside a chat model)."""
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.input_modalities = ("text", "image") if engine.image_limits else ("text",)
        self.task, self.supported_tasks = engine.task, engine.supported_tasks
        self.lora_registry = engine.lora_registry  # its lookups are safe from any thread
        self._on_stats = on_stats
        self._turns = turns
        if turns is not None:
            turns.join(engine, yields)
        self._inbox: deque[tuple] = deque()
        self._wakeup = threading.Event()
        self._active: dict[str, _Active] = {}
        self._stats = engine.stats()
        self._closed = False
        self._dead: str | None = None  # why a step found the engine unable to work
        self._templates = ThreadPoolExecutor(CHAT_TEMPLATE_THREADS, thread_name_prefix="tiffin-chat-template")
        self.tokenizing = TokenizePool()
        self._init_watchdog(engine.config.engine_stall_timeout, on_step_age)
        self._init_sleep_mode()
        self._thread = threading.Thread(target=self._run, name="tiffin-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(
        cls,
        model: str,
        on_stats: Callable[[EngineStats], None] | None = None,
        turns: StepTurns | None = None,
        yields: bool = False,
        on_step_age: Callable[[float], None] | None = None,
        **kwargs,
    ) -> "AsyncLLMEngine":
        """Build the LLMEngine (or the front of data_parallel_size of them) from `EngineConfig` fields (the same
        keywords as `LLM`)."""
        return cls(make_engine(EngineConfig(model=str(model), **kwargs)), on_stats, turns, yields, on_step_age)

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
        client: str | None = None,
    ) -> RequestStream:
        """Queue a request and return its stream once the engine accepted it; ValueError if it was refused
        (bad prompt, too long for the context, duplicate id, an adapter that cannot load), QueueFull if too many
        wait already, EngineError if the engine is shut down or dead; raised before any output. The prompt is
        tokenized, a structured-outputs grammar compiled (`compile_grammar`) and an adapter not cached read first,
        all off the engine thread (steps go on meanwhile). `client`: who sent it, for fair share (None: anonymous).
        While the engine sleeps, EngineAsleep or a wait (`AsyncSleepMode`)."""
        self._check_running()
        params = params or (SamplingParams() if self.task == "generate" else PoolingParams(self.engine.pooling_task))
        pooling = params if isinstance(params, PoolingParams) else None
        prompt = await self.tokenize(prompt, pooling)
        if pooling is None and params.structured_outputs is not None:
            await self.compile_grammar(params.structured_outputs)
        lora = lora_request
        if lora is not None and not (self.lora_registry and self.lora_registry.is_cached(lora.lora_int_id)):
            lora = await asyncio.to_thread(self.engine.load_lora, lora)
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self.engine.config.asleep_request_wait
        while True:
            await self._await_awake(deadline)
            accepted = loop.create_future()
            stream = RequestStream(request_id, self.abort)
            self._check_running()  # again: the engine may have stalled while the prompt was prepared
            self._post(("add", request_id, prompt, params, lora, client, stream, loop, accepted))
            try:
                await accepted
            except asyncio.CancelledError:
                stream.close()
                raise
            except BaseException as e:
                stream.finished = True  # refused: there is nothing to abort
                if isinstance(e, EngineAsleep) and time.monotonic() < deadline:
                    continue  # it went to sleep as the request arrived: wait for the wake
                raise
            return stream

    async def compile_grammar(self, structured: StructuredOutputsParams) -> None:
        """Wait until `structured`'s grammar is compiled and cached, where the engine will find it. ParamError if
        it fails, or takes longer than grammar_compile_timeout: a compile cannot be interrupted, so it goes on in
        the background and is cached, while one still queued that nobody waits for is dropped (QueueFull if
        too many are compiling already)."""
        backend = await asyncio.to_thread(self.engine.grammars)  # the first call imports xgrammar
        timeout = self.engine.config.grammar_compile_timeout
        loop = asyncio.get_running_loop()
        compiled = loop.create_future()  # of our own: cancelling it on timeout leaves the compile alone
        future = backend.compile(structured, waiter=True)
        future.add_done_callback(lambda _: _call(loop, _settle, compiled, None, None))
        try:
            await asyncio.wait_for(compiled, timeout)
        except TimeoutError:
            message = f"structured_outputs: the grammar did not compile within grammar_compile_timeout={timeout:g} s"
            raise ParamError("structured_outputs", message) from None
        finally:
            backend.release(structured.key, future)
        if future.exception() is not None:
            raise ParamError("structured_outputs", f"structured_outputs: {compile_error(future.exception())}")

    async def tokenize(
        self, prompt: PromptType, pooling: PoolingParams | None = None, fit_context: bool = True
    ) -> TokenizedPrompt:
        """`LLMEngine.tokenize` on the engine's tokenizing threads (tokenizers release the GIL): steps and the event
        loop go on."""
        return await self.tokenizing.run(self.engine.tokenize, prompt, pooling, fit_context)

    async def render_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs
    ) -> TokenizedPrompt:
        """`LLMEngine.render_chat` on a chat-template thread: however long a template runs (up to its timeout),
        steps, the event loop and the tokenizing of other prompts go on."""
        self._check_running()
        render = functools.partial(self.engine.render_chat, messages, add_generation_prompt, **template_kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._templates, render)

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
        client: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """vLLM's `AsyncLLMEngine.generate`: cumulative outputs until the request finishes."""
        stream = await self.add_request(request_id or uuid.uuid4().hex, prompt, params, lora_request, client)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter (read and checked in a worker thread: steps go on meanwhile), then add it to the
        engine's registry. False if it was cached already; ValueError if it cannot be served."""
        lora = await asyncio.to_thread(self.engine.load_lora, lora_request)
        return await self._call_engine("add_lora", lora)

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter; requests already using it finish with it."""
        return await self._call_engine("remove_lora", lora_int_id)

    async def list_loras(self) -> set[int]:
        return await self._call_engine("list_loras")

    async def _call_engine(self, method: str, *args):
        self._check_running()
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._post(("call", method, args, loop, done))
        return await done

    def abort(self, request_id: str, wake: bool = True) -> None:
        """Thread-safe; the request's stream (if still read) ends with finish_reason "abort". `wake=False`
        only queues it, taking no lock (for finalizers)."""
        self._inbox.append(("abort", request_id))
        if wake:
            self._wakeup.set()

    @property
    def dead(self) -> str | None:
        """Why the engine stopped working, once it did: a failed step, or a tensor-parallel worker found dead
        while the engine idles."""
        return self._dead or self._stall_message() or self.engine.failure()

    @property
    def healthy(self) -> bool:
        return self.dead is None and not self._closed

    @property
    def ready(self) -> bool:
        """Healthy, and no tokenization has waited over `tokenize_pool.READY_WAIT` for a thread: a replica whose
        tokenizing threads are all held by long texts is not ready for more (the Bento's /readyz); nor is a
        data-parallel engine whose replicas are all being restarted."""
        serving = getattr(self.engine, "serving", None)
        return self.healthy and self.tokenizing.waited() <= tokenize_pool.READY_WAIT and (serving is None or serving())

    def _check_running(self) -> None:
        if self.dead is not None:
            raise (EngineError if self._dead or self._stalled is None else EngineStalled)(self.dead)
        if self._closed:
            raise EngineError("the engine is shut down")

    def stats(self) -> EngineStats:
        """`LLMEngine.stats()` as of the last step or inbox batch."""
        return self._stats

    def shutdown(self, timeout: float = 10.0) -> None:
        """Fail the requests in flight and stop the engine thread."""
        self._closed = True
        self._watchdog.stop()
        self._post(("shutdown",))
        self._thread.join(timeout)
        self._templates.shutdown(wait=False, cancel_futures=True)
        self.tokenizing.shutdown()

    def _post(self, op: tuple) -> None:
        self._inbox.append(op)
        self._wakeup.set()

    # --- engine thread ---

    def _run(self) -> None:
        engine = self.engine
        while True:
            idle = not engine.has_unfinished_requests()
            if idle and not self._run_exclusive() and not self._wait_for_work(self._idle_timeout()):
                self._sleep_when_idle()
            self._wakeup.clear()
            with self._lock:  # everything but the step runs under the lock that the watchdog's trip takes
                if not self._drain_inbox():
                    return
                self._recover()
            if not engine.has_unfinished_requests():
                continue
            try:
                with nullcontext() if self._turns is None else self._turns.step(engine):
                    outputs = engine.step()
            except Exception as e:  # step() isolates failing requests itself: the engine is broken
                logger.exception("engine step failed")
                with self._stepped():
                    self._dead = f"engine failed: {type(e).__name__}: {e}"
                    self._fail_all(EngineError(self._dead))
                continue
            with self._stepped():
                self._publish_stats()  # first, so a client that sees its last token also sees it counted
                self._emit(outputs)

    def _drain_inbox(self) -> bool:
        """Apply queued adds and aborts; False once shutdown was requested."""
        if not self._inbox:
            return True
        while self._inbox:
            op = self._inbox.popleft()
            if op[0] == "add" and self._exclusives:  # after a sleep / wake / reload: held until it ran
                self._held.append(op)
            elif op[0] == "add":
                self._add(*op[1:])
            elif op[0] == "abort":
                self._abort(op[1])
            elif op[0] == "call":
                self._engine_call(*op[1:])
            elif op[0] == "exclusive":
                self._queue_exclusive(op)
            else:
                self._fail_all(EngineError("the engine is shut down"), [*self._held, *self._exclusives])
                self.engine.shutdown()
                return False
        self._publish_stats()
        return True

    def _add(self, request_id, prompt, params, lora, client, stream, loop, accepted) -> None:
        try:
            self._check_running()
            self._wake_for_request()
            self.engine.add_request(request_id, prompt, params, lora, client)
        except Exception as e:
            _call(loop, _settle, accepted, None, e)
            return
        self._active[request_id] = _Active(stream, loop)
        _call(loop, _settle, accepted, None, None)

    def _engine_call(self, method: str, args: tuple, loop, done) -> None:
        try:
            result = getattr(self.engine, method)(*args)
        except Exception as e:
            _call(loop, _settle, done, None, e)
            return
        _call(loop, _settle, done, result, None)

    def _abort(self, request_id: str) -> None:
        self._emit(self.engine.abort_request(request_id))

    def _emit(self, outputs: list[RequestOutput]) -> None:
        """Hand each output to its request's stream: one wake-up per event loop, not one per request."""
        items = []
        for out in outputs:
            active = self._active.get(out.request_id)
            if active is None:
                continue
            if out.finished:
                del self._active[out.request_id]
            items.append((active, out if out.error is None else EngineError(out.error)))
        self._push(items)

    def _fail_all(self, error: EngineError, pending: list[tuple] = ()) -> None:
        """Fail every request in flight, and the adds and calls `pending` (held back) with them."""
        for op in pending:
            loop, future = (op[7], op[8]) if op[0] == "add" else (op[3], op[4])
            _call(loop, _settle, future, None, error)
        for request_id in self._active:
            self.engine.abort_request(request_id)
        items = [(active, error) for active in self._active.values()]
        self._active.clear()
        self._push(items)
        self._publish_stats()

    def _push(self, items: list[tuple[_Active, object]]) -> None:
        """Put each item on its stream's queue, in one call per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Active, object]]] = {}
        for active, item in items:
            by_loop.setdefault(active.loop, []).append((active, item))
        for loop, group in by_loop.items():
            if not _call(loop, _put_all, [(active.stream.queue, item) for active, item in group]):
                for active, _ in group:  # their event loop is gone
                    self.engine.abort_request(active.stream.request_id)
                    self._active.pop(active.stream.request_id, None)

    def _publish_stats(self) -> None:
        self._stats = self.engine.stats()
        if self._on_stats is not None:
            try:
                self._on_stats(self._stats)
            except Exception:
                logger.exception("on_stats callback failed")


def _call(loop: asyncio.AbstractEventLoop, fn, *args) -> bool:
    try:
        loop.call_soon_threadsafe(fn, *args)
        return True
    except RuntimeError:  # the loop is closed
        return False


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.done():  # the caller was cancelled meanwhile
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
