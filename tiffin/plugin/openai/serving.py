"""`OpenAIServing`: OpenAI requests run on an `AsyncLLMEngine`, answered whole or as server-sent events.

Invariants:
- Every request the engine was given is aborted when its answer is no longer wanted: a prompt of a batch is
  refused, another prompt's stream fails, the client disconnects, or a stream's reader stops.
- A failure before the first byte is an `APIError` (the app answers it in OpenAI's error shape); once a stream
  has started it is reported in-band, as one error event, and every stream ends with `data: [DONE]`.
- A request's structured outputs are checked off the event loop and its grammar compiled before it is queued,
  each within grammar_compile_timeout: past a limit, the deadline or a failed compile, it is a 400 naming the
  field that asked for it. A grammar that fails later (a rejected token) fails its request alone, as a 500,
  while the engine keeps serving.
- `on_finished` sees each finished request once.
- A whole answer, and a stream's first and last events (those that echo the request or carry the whole answer),
  are built and encoded as JSON on a worker thread (tiffin.plugin.openai.encoding); only the small deltas of a
  stream are encoded on the event loop."""

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from tiffin.engine.errors import ParamError, QueueFull
from tiffin.engine.outputs import RequestOutput
from tiffin.engine.sampling_params import SamplingParams
from tiffin.plugin.openai.answer import AnswerReader
from tiffin.plugin.openai.clients import client_of, min_priority
from tiffin.plugin.openai.encoding import built_json_response
from tiffin.plugin.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingRequest,
    bad_request,
)
from tiffin.plugin.openai.responses import AnswerBuilder, ChatResponses, CompletionResponses
from tiffin.plugin.openai.structured import as_field, off_loop
from tiffin.plugin.openai.tools import ChatTool, ToolParser, make_parser, template_messages

if TYPE_CHECKING:  # torch, which `bentoml build` need not import
    from tiffin.engine.async_llm_engine import AsyncLLMEngine, RequestStream
    from tiffin.engine.input_processor import TokenizedPrompt
    from tiffin.engine.lora.request import LoRARequest
    from tiffin.plugin.lora import LoRAServing

Answer = Response | StreamingResponse  # JSON encoded off the loop, or the SSE stream when the request streams
T = TypeVar("T")


class OpenAIServing:
    """The OpenAI endpoints of one engine: its base model under `model_name`, and its loaded LoRA adapters."""

    def __init__(
        self,
        engine: "AsyncLLMEngine",
        model_name: str,
        on_finished: "Callable[[RequestStream, RequestOutput], None] | None" = None,
        lora: "LoRAServing | None" = None,
        tool_parser: str = "auto",
    ) -> None:
        """`on_finished(stream, output)` is called for each finished request (metrics). `lora`: set when
        adapters are enabled. `tool_parser`: the tool-call convention, "auto" to follow the chat template."""
        self.engine = engine
        self.model_name = model_name
        self.created = int(time.time())
        self.on_finished = on_finished
        self.lora = lora
        self.tool_parser: ToolParser = make_parser(tool_parser, getattr(engine.tokenizer, "chat_template", None))

    @property
    def tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def serves(self, model: str) -> bool:
        """Whether `model` names the base model or one of its loaded adapters."""
        return model == self.model_name or bool(self.lora and self.lora.registry.get(model))

    def models(self) -> dict:
        """The base model's card, then one per loaded LoRA adapter with the base model as `parent`."""
        card = model_card(self)
        adapters = self.lora.registry.added() if self.lora else []
        cards = [{**card, "id": r.lora_name, "root": r.lora_path, "parent": self.model_name} for r in adapters]
        return {"object": "list", "data": [card, *cards]}

    async def completions(self, req: CompletionRequest, raw: Request) -> Answer:
        lora = self._check_model(req.model)
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.best_of not in (None, 1):
            raise APIError(400, "best_of is not supported", param="best_of")
        prompts = req.prompts()
        params = await self._sampling_params(req, req.max_tokens, req.logprobs)
        if req.echo and req.logprobs is not None and params.prompt_logprobs is None:  # echoed tokens have them too
            params = dataclasses.replace(params, prompt_logprobs=req.logprobs)
        echo = self.engine.tokenizer.decode if req.echo else None
        builder = CompletionResponses(req.model or self.model_name, params.n, req.logprobs, req.include_usage, echo)
        return await self._serve(req, raw, builder, prompts, params, lora)

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Answer:
        def builder(params: SamplingParams, reader: AnswerReader) -> ChatResponses:
            model = req.model or self.model_name
            return ChatResponses(model, params.n, req.logprobs_count, req.include_usage, reader)

        return await self.serve_chat(req, raw, builder)

    async def serve_chat(
        self,
        req: ChatCompletionRequest,
        raw: Request,
        make_builder: "Callable[[SamplingParams, AnswerReader], AnswerBuilder]",
    ) -> Answer:
        """A conversation from any API that speaks chat (chat completions, Responses, Messages), in the shape of
        the builder `make_builder(params, reader)` makes: `reader` reads its choices (reasoning, tool calls)."""
        lora = self._check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = await self._sampling_params(req, max_tokens, req.logprobs_count, self.tool_parser)
        prompt = await self._render_chat(req)
        tool_parser = self.tool_parser if req.uses_tools else None
        reader = AnswerReader.of(self.engine.engine.reasoning, prompt.text, tool_parser)
        return await self._serve(req, raw, make_builder(params, reader), [prompt], params, lora)

    def _check_model(self, model: str | None) -> "LoRARequest | None":
        """The LoRARequest for an adapter's name, None for the base model; 404 for any other name."""
        if model is None or model == self.model_name:
            return None
        lora = self.lora.registry.get(model) if self.lora else None
        if lora is None:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return lora

    async def _render_chat(self, req: ChatCompletionRequest) -> "TokenizedPrompt":
        tools = req.tools if req.uses_tools else None
        return await render_chat(self.engine, req.messages, req.add_generation_prompt, tools, **req.template_kwargs())

    async def _sampling_params(self, req: SamplingRequest, *args) -> SamplingParams:
        """`req.sampling_params(*args)`, on a checking thread when the request constrains its output."""
        field = _constraining_field(req)
        if field is None:
            return req.sampling_params(*args)
        try:
            timeout = self.engine.engine.config.grammar_compile_timeout
            return await off_loop(lambda: req.sampling_params(*args), timeout, field)
        except ValueError as e:
            raise bad_request(e) from None

    async def _serve(
        self,
        req: SamplingRequest,
        raw: Request,
        builder: AnswerBuilder,
        prompts: list,
        params: SamplingParams,
        lora: "LoRARequest | None",
    ) -> Answer:
        if (floor := min_priority(raw)) is not None and params.priority < floor:
            message = f"priority {params.priority} is more urgent than this API key may ask for (lowest: {floor})"
            raise bad_request(ParamError("priority", message))
        streams = await self._open(prompts, params, builder.id, lora, _constraining_field(req), client_of(raw))
        if req.stream:
            return StreamingResponse(self._sse(streams, builder), media_type="text/event-stream")
        finals = await unless_disconnected(raw, self._collect(streams))
        return await built_json_response(lambda: builder.response(finals))

    async def _open(
        self,
        prompts: list,
        params: SamplingParams,
        request_id: str,
        lora: "LoRARequest | None",
        structured_field: str | None,
        client: str | None,
    ) -> list["RequestStream"]:
        """Queue every prompt, sent by `client` (fair share); a refused one aborts those already queued and
        becomes a 400 (a refused grammar names `structured_field`, the request field that asked for it)."""
        streams = []
        try:
            for i, prompt in enumerate(prompts):
                stream = await self.engine.add_request(f"{request_id}-{i}", prompt, params, lora, client=client)
                streams.append(stream)
        except ValueError as e:
            raise bad_request(as_field(e, structured_field)) from None
        except QueueFull as e:
            raise APIError(429, str(e), type="rate_limit_error", code="queue_full") from None
        finally:
            if len(streams) < len(prompts):
                for s in streams:
                    s.close()
        return streams

    async def _collect(self, streams: list["RequestStream"]) -> list[RequestOutput]:
        finals = [None] * len(streams)
        async for i, out in self._merge(streams):
            finals[i] = out
        return finals

    async def _sse(self, streams: list["RequestStream"], builder: AnswerBuilder) -> AsyncIterator[str]:
        finals = [None] * len(streams)
        try:
            for chunk in await _encoded(builder, builder.first_events):
                yield chunk
            async for i, out in self._merge(streams):
                finals[i] = out
                for event in builder.delta_events(i, out):
                    yield builder.sse(event)
            for chunk in await _encoded(builder, lambda: builder.last_events(finals)):
                yield chunk
        except Exception as e:  # the status line is sent already: report in-band
            yield builder.sse(builder.error_event(f"generation failed: {e}"))
        yield builder.stream_end

    async def _merge(self, streams: list["RequestStream"]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, newest output) from several request streams. Outputs are cumulative, so a slow
        reader skips intermediate ones. Leaving early aborts every unfinished request."""
        latest: dict[int, Any] = {}
        ready = asyncio.Event()

        async def pump(i: int, stream: "RequestStream") -> None:
            try:
                async for out in stream:
                    latest[i] = out
                    ready.set()
            except Exception as e:
                latest[i] = e
                ready.set()

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        pending = set(range(len(streams)))
        try:
            while pending:
                await ready.wait()
                ready.clear()
                for i in list(latest):
                    item = latest.pop(i)
                    if isinstance(item, Exception):
                        raise item
                    failed = [o.stop_reason for o in item.outputs if o.finish_reason == "error"]
                    if failed:  # a structured-outputs grammar failed this request (and only it)
                        raise APIError(500, failed[0], type="server_error")
                    if item.finished:
                        pending.discard(i)
                        if self.on_finished is not None:
                            self.on_finished(streams[i], item)
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()
            for s in streams:
                s.close()


async def _encoded(builder: AnswerBuilder, events: "Callable[[], list[dict]]") -> list[str]:
    """The events `events()` makes, as server-sent events, made and encoded on a worker thread: a stream's first
    and last events carry the whole request's echo (a Response's tools and schema) and its final answer."""
    return await asyncio.to_thread(lambda: [builder.sse(event) for event in events()])


async def render_chat(
    engine: "AsyncLLMEngine",
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    tools: list[ChatTool] | None,
    **template_kwargs,
) -> "TokenizedPrompt":
    """The conversation as the engine runs it (/chat/completions) or counts it (/tokenize); a 400 naming `messages`."""
    tools = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    try:
        history = template_messages([m.model_dump(exclude_none=True) for m in messages])
        return await engine.render_chat(history, add_generation_prompt, tools=tools, **template_kwargs)
    except ValueError as e:  # the history, the template (failed or past its limits), or too long a prompt
        message = str(e) if str(e).startswith("messages") else f"messages: {e}"
        raise APIError(400, message, param="messages") from None


def _constraining_field(req: SamplingRequest) -> str | None:
    """The request field whose structured outputs need checking: at most one may constrain the output."""
    if req.response_format is not None and req.response_format.type != "text":
        return "response_format"
    if req.structured_outputs is not None:
        return "structured_outputs"
    return "tools" if getattr(req, "tools", None) else None


def model_card(serving) -> dict:
    """OpenAI's model object for a serving's base model, with the context length, the tasks it serves and what its
    inputs may hold (`input_modalities`, OpenRouter's name: `["text", "image"]` for a vision-language model)."""
    return {
        "id": serving.model_name,
        "object": "model",
        "created": serving.created,
        "owned_by": "tiffin",
        "max_model_len": serving.engine.max_model_len,
        "tasks": list(serving.tasks),
        "input_modalities": list(serving.engine.input_modalities),
    }


async def unless_disconnected(raw: Request, coro: Coroutine[Any, Any, T]) -> T:
    """Await `coro`, cancelling it (so its requests abort) if the client hangs up first."""
    task = asyncio.ensure_future(coro)

    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise APIError(499, "client disconnected")
    return task.result()
