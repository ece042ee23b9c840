"""Anthropic's Messages API (/v1/messages) over the chat machinery: a `MessagesRequest` becomes a
`ChatCompletionRequest` run by `OpenAIServing.serve_chat`, its answer a message of content blocks
(`MessagesBuilder`), its failures Anthropic's error shape (`error_body`).

Invariants:
- A message's blocks come in the order the model wrote their parts: `thinking` (when the model thought), `text`
  (when it wrote any), then each `tool_use`. A stream opens them in that order, a text block once there is text, a
  tool_use block whole once its call is complete (start, one input_json_delta with all of its input, stop), so the
  streamed blocks add up to the non-streamed ones (text that a model writes after a call in "auto" mode, which no
  grammar forbids, streams as one more text block).
- Every refusal is a 400 that names the field as Anthropic spells it (the chat fields it became are renamed back);
  a failure after a stream's first event is one in-band `error` event.
- `thinking` {type: enabled} is a thinking budget (`thinking_token_budget`), {type: disabled} the chat template's
  `enable_thinking` false; with {type: adaptive} or none a thinking model thinks as its template has it. Thinking
  blocks of the history reach the template as `reasoning_content`, which templates that replay reasoning read
  (Qwen3's) and others ignore; their signatures are not checked, and ours are empty."""

import json
import uuid
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from tiffin.engine.outputs import CompletionOutput, RequestOutput
from tiffin.engine.sampling_params import SamplingParams
from tiffin.plugin.openai.answer import Answer, AnswerReader, AnswerStream
from tiffin.plugin.openai.protocol import (
    APIError,
    Bool,
    ChatCompletionRequest,
    Float,
    Int,
    Name,
    Text,
    _Body,
    image_url_part,
)
from tiffin.plugin.openai.responses import AnswerBuilder
from tiffin.plugin.openai.serving import OpenAIServing, render_chat
from tiffin.plugin.openai.tools import ToolCall


class _Block(BaseModel):
    model_config = ConfigDict(extra="ignore")  # cache_control, citations: nothing to do with them here


class TextBlock(_Block):
    type: Literal["text"]
    text: Text


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: Text
    signature: Text | None = None


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: Name
    name: Name
    input: dict[str, Any]


class ImageBlock(_Block):
    """An image in a user message: `source` {type: base64, media_type, data}, or {type: url, url} (which the chat
    path refuses unless its host is allowed); checked in `_image`."""

    type: Literal["image"]
    source: Any = None


class MediaBlock(_Block):
    """Documents, refused by name."""

    type: Literal["document"]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: Name
    content: list[Annotated[TextBlock | ImageBlock | MediaBlock, Field(discriminator="type")]] | Text = ""
    is_error: Bool | None = None


Block = Annotated[
    TextBlock | ThinkingBlock | ToolUseBlock | ToolResultBlock | ImageBlock | MediaBlock, Field(discriminator="type")
]
# the blocks each role's message may hold
_ROLE_BLOCKS = {
    "user": (TextBlock, ImageBlock, ToolResultBlock),
    "assistant": (TextBlock, ThinkingBlock, ToolUseBlock),
}
# the media types Anthropic's API takes for a base64 image
_IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


class Message(BaseModel):
    role: Literal["user", "assistant"]
    content: list[Block] | Text


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["custom"] | None = None  # server tools (web_search, bash, ...) are Anthropic's to run
    name: Name
    description: Text | None = None
    input_schema: dict[str, Any]


class ToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: Name | None = None
    disable_parallel_tool_use: Bool | None = None


class ThinkingEnabled(BaseModel):
    type: Literal["enabled"]
    budget_tokens: Int


class ThinkingDisabled(BaseModel):
    type: Literal["disabled"]


class ThinkingAdaptive(BaseModel):
    """The model decides: a thinking model thinks as its chat template has it."""

    type: Literal["adaptive"]


Thinking = Annotated[ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive, Field(discriminator="type")]
# fields a chat request spells as the Messages API does
_CHAT_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "stream", "priority", "seed"}
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # and "tool": the named function
# chat fields that refusals name, as the Messages API spells them
_MESSAGES_FIELDS = {
    "stop": "stop_sequences",
    "thinking_token_budget": "thinking.budget_tokens",
    "chat_template_kwargs": "thinking",
    "parallel_tool_calls": "tool_choice",
}


class MessagesRequest(_Body):
    model_config = ConfigDict(extra="ignore")  # metadata, service_tier, ...: nothing to do with them here
    model: Name
    max_tokens: Int  # required, as Anthropic's API has it (not by /messages/count_tokens)
    messages: list[Message] = Field(min_length=1)
    system: Text | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: list[Text] | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Int | None = None
    stream: Bool | None = None
    thinking: Thinking | None = None
    mcp_servers: list[Any] | None = None  # Anthropic's MCP connector: refused when given, none runs here
    # tiffin's and vLLM's extras
    priority: Int | None = None
    seed: Int | None = None

    def chat_request(self) -> ChatCompletionRequest:
        """The chat request that asks the same; APIError naming a field that cannot be translated."""
        if self.mcp_servers:
            message = "mcp_servers is not supported: this server connects to no MCP server"
            raise APIError(400, message, param="mcp_servers")
        chat = {
            **self.model_dump(include=_CHAT_FIELDS),
            "stop": self.stop_sequences,
            "messages": self._chat_messages(),
        }
        if self.tools:
            chat["tools"] = [
                {
                    "type": "function",
                    "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
                }
                for t in self.tools
            ]
        if self.tool_choice is not None:
            chat["tool_choice"] = self._chat_tool_choice()
            chat["parallel_tool_calls"] = not self.tool_choice.disable_parallel_tool_use
        if isinstance(self.thinking, ThinkingEnabled):
            chat["thinking_token_budget"] = self.thinking.budget_tokens
        elif isinstance(self.thinking, ThinkingDisabled):
            chat["chat_template_kwargs"] = {"enable_thinking": False}
        return ChatCompletionRequest.model_validate(chat)

    def _chat_tool_choice(self) -> str | dict:
        choice = self.tool_choice
        if choice.type != "tool":
            return _TOOL_CHOICES[choice.type]
        if choice.name is None:
            raise APIError(400, "tool_choice.name: required when tool_choice.type is 'tool'", param="tool_choice")
        return {"type": "function", "function": {"name": choice.name}}

    def _chat_messages(self) -> list[dict]:
        system = self.system if self.system is None or isinstance(self.system, str) else _joined(self.system)
        chat = [] if system is None else [{"role": "system", "content": system}]
        for i, message in enumerate(self.messages):
            chat += _chat_turn(message, f"messages.{i}")
        return chat


def _chat_turn(message: Message, where: str) -> list[dict]:
    """One message as chat messages: a user's tool results become `tool` messages ahead of its text, an assistant's
    tool uses its `tool_calls` (arguments as JSON text, as OpenAI sends them)."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    parts, thoughts, calls, results = [], [], [], []  # parts: chat content parts (text, image_url)
    for j, block in enumerate(message.content):
        at = f"{where}.content.{j}"
        _refuse_media(block, at)
        if not isinstance(block, _ROLE_BLOCKS[message.role]):
            raise APIError(400, f"{at}: a {message.role} message cannot hold {block.type} blocks", param="messages")
        if isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock):
            parts.append(_image(block, at))
        elif isinstance(block, ThinkingBlock):
            thoughts.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append({"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}})
        else:
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _result_text(block, at)})
    texts = [p["text"] for p in parts if p["type"] == "text"]
    if message.role == "user":
        content = "\n".join(texts) if len(texts) == len(parts) else parts
        return results + ([{"role": "user", "content": content}] if parts or not results else [])
    turn = {"role": "assistant", "content": "\n".join(texts)}
    if thoughts:
        turn["reasoning_content"] = "\n".join(thoughts)
    if calls:
        turn["tool_calls"] = calls
    return [turn]


def _result_text(block: ToolResultBlock, where: str) -> str:
    if isinstance(block.content, str):
        text = block.content
    else:
        for j, part in enumerate(block.content):
            _refuse_media(part, f"{where}.content.{j}")
            if isinstance(part, ImageBlock):  # a tool message is text to the chat template
                raise APIError(400, f"{where}.content.{j}: images in tool results are not supported",
                               param="messages")  # fmt: skip
        text = _joined(block.content)
    # chat templates know no error flag: the model reads it in the result
    return f"Error: {text}" if block.is_error else text


def _refuse_media(block: BaseModel, where: str) -> None:
    if isinstance(block, MediaBlock):
        raise APIError(400, f"{where}: {block.type} blocks are not supported (this server reads text and images)",
                       param="messages")  # fmt: skip


def _image(block: ImageBlock, where: str) -> dict:
    """An image block as the chat `image_url` part it stands for: base64 data as a data: URL."""
    source = block.source if isinstance(block.source, dict) else {}
    kind = source.get("type")
    if kind == "url":
        return image_url_part(source.get("url"), f"{where}.source.url", "messages")
    if kind != "base64":
        raise APIError(400, f"{where}.source: must be {{type: base64, media_type, data}} or {{type: url, url}}",
                       param="messages")  # fmt: skip
    media = source.get("media_type")
    if media not in _IMAGE_MEDIA_TYPES:
        raise APIError(400, f"{where}.source.media_type: must be one of {', '.join(_IMAGE_MEDIA_TYPES)}, got "
                       f"{str(media)[:64]!r}", param="messages")  # fmt: skip
    data = source.get("data")
    if not isinstance(data, str) or not data:
        raise APIError(400, f"{where}.source.data: must be the image's bytes in base64, a string", param="messages")
    return image_url_part(f"data:{media};base64,{data}", where, "messages")


def _joined(blocks: list[TextBlock]) -> str:
    return "\n".join(b.text for b in blocks)


async def serve_messages(serving: OpenAIServing, req: MessagesRequest, raw: Request) -> dict | StreamingResponse:
    """`req` answered by `serving`'s engine: a message, or its events when `req.stream`."""

    def builder(params: SamplingParams, reader: AnswerReader) -> MessagesBuilder:
        return MessagesBuilder(req.model, reader)

    try:
        return await serving.serve_chat(req.chat_request(), raw, builder)
    except APIError as e:
        raise e.renamed(_MESSAGES_FIELDS) from None


class CountTokensRequest(MessagesRequest):
    """/messages/count_tokens: a message request but for its length limit."""

    max_tokens: Int | None = None


async def count_tokens(serving: OpenAIServing, req: CountTokensRequest) -> dict:
    """The prompt tokens `req` would run, counted even past the context (as /tokenize counts)."""
    try:
        chat = req.chat_request()
        tools = chat.tools if chat.uses_tools else None
        kwargs = chat.template_kwargs()
        prompt = await render_chat(serving.engine, chat.messages, True, tools, fit_context=False, **kwargs)
    except APIError as e:
        raise e.renamed(_MESSAGES_FIELDS) from None
    return {"input_tokens": len(prompt.token_ids)}


_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(e: APIError) -> dict:
    """`e` in Anthropic's error shape: its type follows from the status."""
    kind = _ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


class MessagesBuilder(AnswerBuilder):
    """One request's message (Messages requests have one choice), read by `reader`; streamed as `message_start`
    (with the first output: it carries the prompt's token counts), each block's start, deltas and stop, then
    `message_delta` (stop reason, output tokens) and `message_stop`."""

    named_events = True

    def __init__(self, model: str, reader: AnswerReader) -> None:
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.model, self.reader = model, reader
        self._stream = AnswerStream(reader)
        self._started = False
        self._blocks = 0  # blocks opened so far
        self._open: str | None = None  # the type of the block open now

    def response(self, finals: list[RequestOutput]) -> dict:
        final = finals[0]
        o = final.outputs[0]
        answer = self.reader.read(o.text, cut=o.finish_reason == "length")
        stop_reason, stop_sequence = _stop(o, answer.calls)
        usage = {**_input_usage(final), "output_tokens": len(o.token_ids)}
        return {**self._message(_content(answer), usage), "stop_reason": stop_reason, "stop_sequence": stop_sequence}

    def delta_events(self, prompt_index: int, out: RequestOutput) -> list[dict]:
        o = out.outputs[0]
        events = []
        if not self._started:
            self._started = True
            message = self._message([], {**_input_usage(out), "output_tokens": 0})
            events.append({"type": "message_start", "message": {**message, "stop_reason": None, "stop_sequence": None}})
        new = self._stream.update(o.text, o.finished, o.finish_reason == "length")
        if new.reasoning:
            events += self._extend("thinking", {"type": "thinking_delta", "thinking": new.reasoning})
        if new.content:
            events += self._extend("text", {"type": "text_delta", "text": new.content})
        for call in new.calls:
            use = _tool_use(call)
            events += self._open_block({**use, "input": {}})
            events.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
            events += self._close()
        if o.finished:
            events += self._close()
        return events

    def last_events(self, finals: list[RequestOutput | None]) -> list[dict]:
        o = finals[0].outputs[0]
        stop_reason, stop_sequence = _stop(o, self._stream.calls)
        return [
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": {"output_tokens": len(o.token_ids)},
            },
            {"type": "message_stop"},
        ]

    def error_event(self, message: str) -> dict:
        return error_body(APIError(500, message))

    def _message(self, content: list[dict], usage: dict) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "usage": usage,
        }

    def _extend(self, kind: str, delta: dict) -> list[dict]:
        """`delta` to the open block of `kind`, opening one first if the open block is another."""
        empty = {"type": kind, kind: "", **({"signature": ""} if kind == "thinking" else {})}
        return [*(self._open_block(empty) if self._open != kind else []), self._delta(delta)]

    def _open_block(self, block: dict) -> list[dict]:
        events = self._close()
        self._open = block["type"]
        events.append({"type": "content_block_start", "index": self._blocks, "content_block": block})
        self._blocks += 1
        return events

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self._blocks - 1, "delta": delta}

    def _close(self) -> list[dict]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": self._blocks - 1}]


def _content(answer: Answer) -> list[dict]:
    thinking = [{"type": "thinking", "thinking": answer.reasoning, "signature": ""}] if answer.reasoning else []
    text = [{"type": "text", "text": answer.content}] if answer.content else []
    return [*thinking, *text, *map(_tool_use, answer.calls)]


def _tool_use(call: ToolCall) -> dict:
    use_id = f"toolu_{call.id.removeprefix('call_')}"
    return {"type": "tool_use", "id": use_id, "name": call.name, "input": json.loads(call.arguments)}


def _stop(o: CompletionOutput, calls: list[ToolCall]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished output: the engine's stop_reason is the stop string that ended
    it, or the stop token's id, or None."""
    if o.finish_reason == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if isinstance(o.stop_reason, str):
        return "stop_sequence", o.stop_reason
    return "end_turn", None


def _input_usage(out: RequestOutput) -> dict:
    """Anthropic counts prompt tokens read from the cache apart from the others."""
    cached = out.num_cached_tokens
    return {"input_tokens": len(out.prompt_token_ids) - cached, "cache_read_input_tokens": cached}
