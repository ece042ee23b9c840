"""The OpenAI-compatible protocol over `AsyncLLMEngine`: request models, validation into SamplingParams,
responses and SSE chunks, OpenAI-shaped errors.

No BentoML here: `create_app()` returns the FastAPI app and the service sets `app.state.serving` to an
`OpenAIServing` once the weights are loaded (503 until then). Nothing heavy is imported at module level."""

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, Strict, model_validator
from starlette.exceptions import HTTPException

from tiffin.engine.chat import render_chat
from tiffin.engine.errors import ParamError, QueueFull
from tiffin.engine.sampling_params import SamplingParams
from tiffin.plugin.structured import ResponseFormat, request_structured_outputs
from tiffin.plugin.tools import (
    ChatTool,
    ToolCallStream,
    ToolChoice,
    ToolParser,
    assistant_message,
    make_parser,
    template_messages,
)

Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]  # accepts JSON integers, not strings or booleans
Bool = Annotated[bool, Strict()]
Name = Annotated[str, Strict(), Field(max_length=256)]  # echoed back in errors: kept short


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# --- requests ---


class _Body(BaseModel):
    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, body):
        """JSON may escape a lone surrogate, which no encoder (tokenizer, JSON response) accepts."""
        for key, value in body.items() if isinstance(body, dict) else ():
            stack = [value]
            while stack:  # not recursive: nesting depth is the client's choice
                item = stack.pop()
                if isinstance(item, str):
                    try:
                        item.encode()
                    except UnicodeEncodeError:
                        raise APIError(400, f"{key}: text must be valid Unicode (lone surrogate)", param=key) from None
                elif isinstance(item, dict):
                    stack += [*item, *item.values()]
                elif isinstance(item, list):
                    stack += item
        return body


class StreamOptions(BaseModel):
    include_usage: Bool = False


class _SamplingRequest(_Body):
    """Fields shared by /completions and /chat/completions (null means the default)."""

    model_config = ConfigDict(extra="ignore")
    model: Name | None = None
    n: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    stop: str | list[str] | None = None
    seed: Int | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    logit_bias: dict[str, float] | None = None
    user: Name | None = None
    stream: Bool | None = None
    stream_options: StreamOptions | None = None
    # vLLM extras
    top_k: Int | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    ignore_eos: Bool | None = None
    min_tokens: Int | None = None
    stop_token_ids: list[Int] | None = None
    include_stop_str_in_output: Bool | None = None
    skip_special_tokens: Bool | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's: json | regex | choice | grammar | json_object

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, tool_parser: ToolParser | None = None
    ) -> SamplingParams:
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
        given = {k: v for k, v in self.model_dump(include=_SAMPLING_FIELDS).items() if v is not None}
        try:
            structured = request_structured_outputs(
                self.response_format, self.structured_outputs, *self._tool_request(), tool_parser
            )
            return SamplingParams(**given, max_tokens=max_tokens, logprobs=logprobs, structured_outputs=structured)
        except ValueError as e:
            raise bad_request(e) from None

    def _tool_request(self) -> tuple:
        """(tools, tool_choice, parallel_tool_calls) where the endpoint takes tools."""
        return None, None, True

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


_SAMPLING_FIELDS = {
    "n",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
}


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    max_tokens: Int | None = 16  # null: up to the context length
    logprobs: Int | None = None
    echo: Bool | None = None
    suffix: str | None = None
    best_of: Int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... reach the chat template
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: Bool | None = None
    top_logprobs: Int | None = None
    add_generation_prompt: Bool = True
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, else "none"
    parallel_tool_calls: Bool = True

    def _tool_request(self) -> tuple:
        return self.tools, self.tool_choice, self.parallel_tool_calls

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


class LoadLoRAAdapterRequest(_Body):
    lora_name: Annotated[str, Strict()]
    lora_path: Annotated[str, Strict(), Field(max_length=4096)]


class UnloadLoRAAdapterRequest(_Body):
    lora_name: Annotated[str, Strict()]


def bad_request(e: ValueError) -> APIError:
    """A refused request as a 400, naming the parameter at fault when validation raised a ParamError."""
    return APIError(400, str(e), param=e.param if isinstance(e, ParamError) else None)


# --- serving ---


class OpenAIServing:
    def __init__(self, engine, model_name: str, on_finished=None, lora=None, tool_parser: str = "auto"):
        """`engine`: an AsyncLLMEngine. `on_finished(stream, output)` is called for each finished request
        (metrics). `lora`: a `tiffin.plugin.lora.LoRAServing` when adapters are enabled. `tool_parser`: the
        tool-call convention, "auto" to follow the chat template."""
        self.engine = engine
        self.model_name = model_name
        self.created = int(time.time())
        self.on_finished = on_finished
        self.lora = lora
        self.tool_parser: ToolParser = make_parser(tool_parser, getattr(engine.tokenizer, "chat_template", None))

    def models(self) -> dict:
        """The base model's card, then one per loaded LoRA adapter with the base model as `parent`."""
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "tiffin",
            "max_model_len": self.engine.max_model_len,
        }
        adapters = self.lora.registry.added() if self.lora else []
        cards = [{**card, "id": r.lora_name, "root": r.lora_path, "parent": self.model_name} for r in adapters]
        return {"object": "list", "data": [card, *cards]}

    async def completions(self, req: CompletionRequest, raw: Request):
        lora = self._check_model(req.model)
        if req.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.best_of not in (None, 1):
            raise APIError(400, "best_of is not supported", param="best_of")
        prompts = _prompts(req.prompt)
        params = req.sampling_params(req.max_tokens, req.logprobs)
        fmt = _Format(
            "cmpl", "text_completion", "text_completion", req.model or self.model_name, params.n, req.logprobs
        )
        return await self._serve(req, raw, fmt, prompts, params, lora)

    async def chat(self, req: ChatCompletionRequest, raw: Request):
        lora = self._check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = req.sampling_params(max_tokens, logprobs, self.tool_parser)
        fmt = _Format(
            "chatcmpl", "chat.completion", "chat.completion.chunk", req.model or self.model_name, params.n, logprobs
        )
        fmt.tool_parser = self.tool_parser if req.uses_tools else None
        prompt = await asyncio.to_thread(self._render_chat, req)  # templates are slow on long text
        try:
            prompt = await self.engine.tokenize(prompt)
        except ParamError as e:
            raise APIError(400, f"messages: {e}", param="messages") from None
        return await self._serve(req, raw, fmt, [prompt], params, lora)

    def _check_model(self, model: str | None):
        """The LoRARequest for an adapter's name, None for the base model; 404 for any other name."""
        if model is None or model == self.model_name:
            return None
        lora = self.lora.registry.get(model) if self.lora else None
        if lora is None:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return lora

    def _render_chat(self, req: ChatCompletionRequest) -> dict:
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        for m in messages:
            if isinstance(m.get("content"), list) and any(p.get("type") != "text" for p in m["content"]):
                raise APIError(400, "only text content parts are supported", param="messages")
        try:
            messages = template_messages(messages)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.uses_tools else None
        try:
            return render_chat(self.engine.tokenizer, messages, req.add_generation_prompt, tools=tools)
        except Exception as e:  # a template may raise on roles or content it does not accept
            raise APIError(400, f"messages: the chat template failed: {e}", param="messages") from None

    async def _serve(self, req: _SamplingRequest, raw: Request, fmt: "_Format", prompts: list, params, lora=None):
        streams = await self._open(prompts, params, fmt.id, lora)
        if req.stream:
            return StreamingResponse(self._sse(streams, fmt, req.include_usage), media_type="text/event-stream")
        finals = await _unless_disconnected(raw, self._collect(streams))
        return fmt.response(finals)

    async def _open(self, prompts: list, params: SamplingParams, request_id: str, lora=None) -> list:
        """Queue every prompt; a refused one aborts those already queued and becomes a 400."""
        streams = []
        try:
            for i, prompt in enumerate(prompts):
                streams.append(await self.engine.add_request(f"{request_id}-{i}", prompt, params, lora))
        except ValueError as e:
            raise bad_request(e) from None
        except QueueFull as e:
            raise APIError(429, str(e), type="rate_limit_error", code="queue_full") from None
        finally:
            if len(streams) < len(prompts):
                for s in streams:
                    s.close()
        return streams

    async def _collect(self, streams: list) -> list:
        finals = [None] * len(streams)
        async for i, out in self._merge(streams):
            finals[i] = out
        return finals

    async def _sse(self, streams: list, fmt: "_Format", include_usage: bool) -> AsyncIterator[str]:
        finals = [None] * len(streams)
        try:
            for chunk in fmt.first_chunks():
                yield _event(chunk)
            async for i, out in self._merge(streams):
                finals[i] = out
                for chunk in fmt.delta_chunks(i, out):
                    yield _event(chunk)
            if include_usage:
                yield _event(fmt.chunk([], usage=_usage(finals)))
        except Exception as e:  # the status line is sent already: report in-band
            yield _event(APIError(500, f"generation failed: {e}", type="server_error").body())
        yield "data: [DONE]\n\n"

    async def _merge(self, streams: list) -> AsyncIterator[tuple[int, Any]]:
        """(prompt index, newest output) from several request streams. Outputs are cumulative, so a slow
        reader skips intermediate ones. Leaving early aborts every unfinished request."""
        latest: dict[int, Any] = {}
        ready = asyncio.Event()

        async def pump(i: int, stream) -> None:
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


def _prompts(prompt) -> list:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    return [prompt] if isinstance(prompt[0], int) else prompt


async def _unless_disconnected(raw: Request, coro):
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


def _finite(logprob: float) -> float:
    """JSON has no NaN or infinity; vLLM's floor for -inf."""
    return logprob if math.isfinite(logprob) else -9999.0


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _usage(finals: list) -> dict:
    prompt = sum(len(f.prompt_token_ids) for f in finals if f is not None)
    completion = sum(len(o.token_ids) for f in finals if f is not None for o in f.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@dataclass
class _Sent:
    """What a stream choice has been sent so far."""

    chars: int = 0
    tokens: int = 0
    text_offset: int = 0  # completions logprobs: where the next token's text starts
    closed: bool = False


class _Format:
    """Response and chunk shapes of one endpoint, and the progress of each streamed choice."""

    def __init__(self, prefix: str, obj: str, chunk_obj: str, model: str, n: int, logprobs: int | None):
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.chat = prefix == "chatcmpl"
        self.obj, self.chunk_obj, self.model, self.n, self.logprobs = obj, chunk_obj, model, n, logprobs
        self.created = int(time.time())
        self.sent: dict[int, _Sent] = {}
        self.tool_parser: ToolParser | None = None  # chat with tools: tool calls are parsed out of the text
        self.tool_streams: dict[int, ToolCallStream] = {}

    def response(self, finals: list) -> dict:
        choices = []
        for i, final in enumerate(finals):
            for o in final.outputs:
                lp = self._logprobs(o, _Sent())
                finish_reason = o.finish_reason
                if self.chat:
                    message, finish_reason = assistant_message(self.tool_parser, o.text, finish_reason)
                    choice = {"message": message, "logprobs": lp}
                else:
                    choice = {"text": o.text, "logprobs": lp}
                choices.append(
                    {
                        "index": i * self.n + o.index,
                        **choice,
                        "finish_reason": finish_reason,
                        "stop_reason": o.stop_reason,
                    }
                )
        return {
            "id": self.id,
            "object": self.obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": _usage(finals),
        }

    def chunk(self, choices: list, usage: dict | None = None) -> dict:
        return {
            "id": self.id,
            "object": self.chunk_obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
        }

    def first_chunks(self) -> list[dict]:
        """Chat streams open each choice with the assistant role."""
        if not self.chat:
            return []
        return [
            self.chunk(
                [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
            )
            for i in range(self.n)
        ]

    def delta_chunks(self, prompt_index: int, out) -> list[dict]:
        chunks = []
        for o in out.outputs:
            index = prompt_index * self.n + o.index
            sent = self.sent.setdefault(index, _Sent())
            text = o.text[sent.chars :]
            new_tokens = len(o.token_ids) > sent.tokens
            if sent.closed or not (text or o.finished or (new_tokens and self.logprobs is not None)):
                continue
            lp = self._logprobs(o, sent)
            sent.chars, sent.tokens, sent.closed = len(o.text), len(o.token_ids), o.finished
            finish_reason = o.finish_reason if o.finished else None
            if self.tool_parser is not None:
                body, finish_reason = self._tool_delta(index, o)
                if not (any(body["delta"].values()) or o.finished or lp):
                    continue  # the new text is held back: it may be part of a tool call
            else:
                body = {"delta": {"content": text}} if self.chat else {"text": text}
            chunks.append(
                self.chunk(
                    [
                        {
                            "index": index,
                            **body,
                            "logprobs": lp,
                            "finish_reason": finish_reason,
                            "stop_reason": o.stop_reason if o.finished else None,
                        }
                    ]
                )
            )
        return chunks

    def _tool_delta(self, index: int, o) -> tuple[dict, str | None]:
        """The delta of a chat choice whose tool calls are parsed out of its text, and its finish_reason."""
        stream = self.tool_streams.setdefault(index, ToolCallStream(self.tool_parser))
        content, calls = stream.update(o.text, o.finished)
        delta = {"content": content, "tool_calls": calls} if calls else {"content": content}
        return {"delta": delta}, stream.finish_reason(o.finish_reason) if o.finished else None

    def _logprobs(self, o, sent: _Sent) -> dict | None:
        """Logprobs of the tokens after `sent.tokens` (advancing `sent.text_offset`)."""
        if self.logprobs is None or o.logprobs is None:
            return None
        entries = []
        for token_id, alternatives in zip(o.token_ids[sent.tokens :], o.logprobs[sent.tokens :]):
            top = sorted(alternatives.values(), key=lambda lp: lp.rank)[: self.logprobs]
            entries.append((alternatives[token_id], top))
        if self.chat:
            item = lambda lp: {
                "token": lp.decoded_token,
                "logprob": _finite(lp.logprob),
                "bytes": list(lp.decoded_token.encode()),
            }
            return {"content": [{**item(s), "top_logprobs": [item(t) for t in top]} for s, top in entries]}
        offsets = []
        for s, _ in entries:
            offsets.append(sent.text_offset)
            sent.text_offset += len(s.decoded_token)
        return {
            "tokens": [s.decoded_token for s, _ in entries],
            "token_logprobs": [_finite(s.logprob) for s, _ in entries],
            "top_logprobs": [{t.decoded_token: _finite(t.logprob) for t in top} for _, top in entries],
            "text_offset": offsets,
        }


# --- app ---


def create_app() -> FastAPI:
    app = FastAPI(title="tiffin OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = None

    def serving(raw: Request) -> OpenAIServing:
        if raw.app.state.serving is None:
            raise APIError(503, "the model is still loading", type="service_unavailable")
        if not raw.app.state.serving.engine.healthy:
            raise APIError(
                503, raw.app.state.serving.engine.dead or "the engine is shut down", type="service_unavailable"
            )
        return raw.app.state.serving

    @app.get("/models")
    async def models(raw: Request):
        return serving(raw).models()

    @app.post("/completions")
    async def completions(req: CompletionRequest, raw: Request):
        return await serving(raw).completions(req, raw)

    @app.post("/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        return await serving(raw).chat(req, raw)

    def lora(raw: Request):
        lora = serving(raw).lora
        if lora is None:
            raise APIError(400, "LoRA adapters are not enabled on this server (set TIFFIN_LORA_ROOTS)")
        return lora

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRAAdapterRequest, raw: Request):
        return PlainTextResponse(await lora(raw).load(req.lora_name, req.lora_path))

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest, raw: Request):
        return PlainTextResponse(await lora(raw).unload(req.lora_name))

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers={"Retry-After": "1"} if e.status == 429 else None)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError):
        err = e.errors()[0]
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            return JSONResponse(APIError(400, f"invalid JSON body: {err.get('msg')}").body(), status_code=400)
        field = loc[0] if loc else None
        where = ".".join(loc) or "body"
        return JSONResponse(APIError(400, f"{where}: {err.get('msg')}", param=field).body(), status_code=400)

    @app.exception_handler(Exception)
    async def server_error(_: Request, e: Exception):
        return JSONResponse(APIError(500, f"{type(e).__name__}: {e}", type="server_error").body(), status_code=500)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(e.status_code, str(e.detail), type=kind).body(), status_code=e.status_code)

    return app
