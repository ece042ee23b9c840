"""What `AsyncLLMEngine.generate` / `add_request` hand back: one request's outputs as an async iterator."""

import asyncio
import time
from collections.abc import Callable

from tiffin.engine.outputs import PoolingRequestOutput, RequestOutput


class RequestStream:
    """Async iterator over one request's outputs. Leaving it early (cancellation, `close()`) aborts the
    request, which frees its KV blocks before the next step. A consumer that fell behind gets the newest output
    queued, and an error only after it: the tokens generated before a failure are never skipped."""

    def __init__(self, request_id: str, abort: Callable[[str, bool], None]):
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self._abort = abort
        self._error: BaseException | None = None  # queued behind an output not yet returned

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput | PoolingRequestOutput:
        if self.finished:
            raise StopAsyncIteration
        if self._error is not None:
            self.finished = True
            raise self._error
        try:
            item = await self.queue.get()
        except asyncio.CancelledError:
            self.close()
            raise
        # Outputs are cumulative: a consumer that fell behind only needs the newest one.
        while not self.queue.empty() and not isinstance(item, BaseException):
            newer = self.queue.get_nowait()
            if isinstance(newer, BaseException):
                self._error = newer
                break
            item = newer
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if self.first_token_time is None and isinstance(item, RequestOutput) and any(o.token_ids for o in item.outputs):
            self.first_token_time = time.monotonic()
        self.finished = item.finished
        return item

    def close(self, wake: bool = True) -> None:
        """Abort the request unless it already finished; safe to call more than once."""
        if not self.finished:
            self.finished = True
            self._abort(self.request_id, wake)

    def __del__(self) -> None:
        # Dropped unread. The garbage collector may run this on the engine thread inside a lock that waking
        # it takes: only queue the abort (an unfinished request keeps the thread stepping, so it is seen).
        self.close(wake=False)
