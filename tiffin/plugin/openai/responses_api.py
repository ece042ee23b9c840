"""OpenAI's Responses API (`POST /responses`, `GET` and `DELETE /responses/{id}`) over the chat path: a request is
translated into a chat completion request (`chat_request`), run by `OpenAIServing.serve_chat`, and answered as a
Response, or as its stream of events (`ResponsesBuilder`).

Invariants:
- The output items of a Response are, in order: a `reasoning` item when the model thought, a `message` once it has
  text, and a `function_call` item per tool call, each sent whole once complete. A stream's items, deltas and final
  Response add up to the non-streamed Response of the same output.
- `previous_response_id` continues the conversation a stored response ended (its input and output, not its
  instructions, as OpenAI's API does); a response is stored (`store`, true by default) for its owner only
  (tiffin.plugin.openai.store).
- What a Response echoes is bounded as OpenAI's API bounds it: `metadata` (16 keys of at most 64 characters,
  values of at most 512), and an unknown field inside a function tool, `tool_choice`, `text` or `text.format` is
  refused by name, never echoed or stored.
- A refused field is named as the Responses API names it (`input`, `text`, `max_output_tokens`, `instructions`
  when they alone exceed the context), not as the chat request it was translated into. Fields of OpenAI's API
  that are not implemented (`UNSUPPORTED`, `background`) are refused by name when given."""

import asyncio
import json
import time
import uuid
from typing import TYPE_CHECKING, Any, Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from tiffin.engine.outputs import RequestOutput
from tiffin.engine.sampling_params import SamplingParams
from tiffin.plugin.openai.answer import AnswerReader, AnswerStream
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
from tiffin.plugin.openai.store import ResponseStore
from tiffin.plugin.openai.tools import ToolCall

if TYPE_CHECKING:
    from tiffin.engine.async_llm_engine import AsyncLLMEngine
    from tiffin.plugin.openai.serving import Answer, OpenAIServing

# `reasoning.effort` as a thinking budget in tokens (vLLM's defaults for low, medium and high); "none" turns thinking
# off in the chat template, a missing effort leaves the model to think as long as it does
EFFORT_BUDGETS = {"minimal": 0, "low": 1024, "medium": 2048, "high": 8192, "xhigh": None}
# chat request fields, as the Responses API names them in errors
FIELD_NAMES = {
    "messages": "input",
    "response_format": "text",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
}
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
# OpenAI's bounds on `metadata`: keys, and characters of a key and of a value
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
# the fields OpenAI's API gives each echoed object; any other is refused by name, as OpenAI refuses an unknown
# parameter (dropping it would hide a client's typo, and echoing it would echo anything, of any size)
FUNCTION_TOOL_FIELDS = ("type", "name", "description", "parameters", "strict")
TOOL_CHOICE_FIELDS = ("type", "name")
TEXT_FIELDS = ("format", "verbosity")
FORMAT_FIELDS = {
    "text": ("type",),
    "json_object": ("type",),
    "json_schema": ("type", "name", "schema", "description", "strict"),
}


class Reasoning(BaseModel):
    model_config = ConfigDict(extra="ignore")
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None  # no summaries: the reasoning text itself is returned


class ResponsesRequest(_Body):
    model_config = ConfigDict(extra="ignore")
    model: Name | None = None
    input: Text | list[dict[str, Any]]
    instructions: Text | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: Bool = True
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    max_output_tokens: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    seed: Int | None = None
    reasoning: Reasoning | None = None
    stream: Bool | None = None
    store: Bool = True
    background: Bool | None = None
    previous_response_id: Name | None = None
    metadata: dict[str, Text] | None = None
    user: Name | None = None
    priority: Int | None = None
    # OpenAI's, not implemented here: refused when given (UNSUPPORTED)
    conversation: Any = None
    prompt: Any = None

    @field_validator("metadata", mode="before")
    @classmethod
    def _bounded_metadata(cls, metadata: Any) -> Any:
        """OpenAI's bounds, checked before the values are validated one by one: metadata is echoed and stored."""
        if not isinstance(metadata, dict):
            return metadata
        if len(metadata) > MAX_METADATA_KEYS:
            message = f"metadata: at most {MAX_METADATA_KEYS} keys, got {len(metadata)}"
            raise APIError(400, message, param="metadata")
        for key, value in metadata.items():
            if len(key) > MAX_METADATA_KEY_CHARS:
                message = f"metadata: a key has {len(key)} characters, at most {MAX_METADATA_KEY_CHARS}"
                raise APIError(400, message, param="metadata")
            if isinstance(value, str) and len(value) > MAX_METADATA_VALUE_CHARS:
                message = f"metadata.{key}: {len(value)} characters, at most {MAX_METADATA_VALUE_CHARS}"
                raise APIError(400, message, param="metadata")
        return metadata

    @field_validator("tools", mode="before")
    @classmethod
    def _known_tool_fields(cls, tools: Any) -> Any:
        for i, tool in enumerate(tools if isinstance(tools, list) else ()):
            if isinstance(tool, dict) and tool.get("type") == "function":
                _only(tool, FUNCTION_TOOL_FIELDS, f"tools[{i}]", "tools")
        return tools

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _known_tool_choice_fields(cls, choice: Any) -> Any:
        if isinstance(choice, dict):
            _only(choice, TOOL_CHOICE_FIELDS, "tool_choice", "tool_choice")
        return choice

    @field_validator("text", mode="before")
    @classmethod
    def _known_text_fields(cls, text: Any) -> Any:
        if not isinstance(text, dict):
            return text
        _only(text, TEXT_FIELDS, "text", "text")
        if text.get("verbosity") not in (None, "low", "medium", "high"):
            raise APIError(400, "text.verbosity: must be low, medium or high", param="text")
        fmt = text.get("format")
        known = FORMAT_FIELDS.get(fmt.get("type")) if isinstance(fmt, dict) else None
        if known is not None:  # another type is refused as the chat request's response_format
            _only(fmt, known, "text.format", "text")
            for key, kind in (("name", str), ("description", str), ("strict", bool)):
                if fmt.get(key) is not None and not isinstance(fmt[key], kind):
                    raise APIError(400, f"text.format.{key}: must be a {kind.__name__}", param="text")
        return text


def _only(value: dict, known: tuple[str, ...], where: str, param: str) -> None:
    """Refuse the first key of `value` not `known`, by name (`where`.key, cut short: it is echoed)."""
    unknown = next((key for key in value if key not in known), None)
    if unknown is not None:
        name = unknown if len(unknown) <= 64 else f"{unknown[:64]}..."
        message = f"{where}.{name}: unknown field; it has {', '.join(known)}"
        raise APIError(400, message, param=param)


# fields of OpenAI's Responses API that tiffin does not implement, refused by name when not null: why, what to use
UNSUPPORTED = {
    "conversation": "conversations are not stored here; continue a response with previous_response_id",
    "prompt": "there are no stored prompt templates here; send the text as instructions and input",
}


def chat_request(req: ResponsesRequest, conversation: list[dict], thinks: bool) -> ChatCompletionRequest:
    """The chat completion request that runs `req` on `conversation` (its input after the history it continues, as
    chat messages). `thinks`: the model has think markers, so `reasoning.effort` sets its thinking."""
    if req.background:
        raise APIError(400, "background is not supported", param="background")
    for name, why in UNSUPPORTED.items():
        if getattr(req, name) is not None:
            raise APIError(400, f"{name} is not supported: {why}", param=name)
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    chat = {
        "model": req.model,
        "messages": system + conversation,
        "max_completion_tokens": req.max_output_tokens,
        "stream": req.stream,
        "parallel_tool_calls": req.parallel_tool_calls,
        **{k: v for k in ("temperature", "top_p", "seed", "user", "priority") if (v := getattr(req, k)) is not None},
    }
    if req.tools:
        chat["tools"] = [_chat_tool(t, i) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        chat["tool_choice"] = _chat_tool_choice(req.tool_choice)
    if req.text is not None and req.text.get("format") is not None:
        chat["response_format"] = _response_format(req.text["format"])
    effort = req.reasoning.effort if req.reasoning else None
    if thinks and effort == "none":
        chat["chat_template_kwargs"] = {"enable_thinking": False}
    elif thinks and effort is not None:
        chat["thinking_token_budget"] = EFFORT_BUDGETS[effort]
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as e:
        error = e.errors(include_url=False)[0]
        field = str(error["loc"][0]) if error["loc"] else "input"
        raise APIError(400, f"{field}: {error['msg']}", param=field).renamed(FIELD_NAMES) from None


def input_messages(items: str | list[dict]) -> list[dict]:
    """Responses input items as chat messages: messages (developer speaks as system), a call's `function_call` item
    as its assistant message's tool call, a `function_call_output` as a tool message; reasoning items are dropped."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}.role: must be user, assistant, system or developer", param="input")
            messages.append({"role": "system" if role == "developer" else role, "content": _content(item, where)})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function"}
            call["function"] = {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _content({"content": output}, where, images=False)
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": content})
        elif kind != "reasoning":
            raise APIError(400, f"{where}: input items of type {kind!r} are not supported", param="input")
    return messages


def _content(item: dict, where: str, images: bool = True) -> str | list[dict]:
    """A message's content: a string, its text parts joined, or, where it holds `input_image` parts (`images`), its
    parts in order as chat parts (text and `image_url`)."""
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content: must be a string or a list of parts", param="input")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image" and images:
            parts.append(_image(part, f"{where}.content[{j}]"))
            continue
        text = part.get("text", part.get("refusal")) if kind in _TEXT_PARTS else None
        if not isinstance(text, str):
            allowed = "text and input_image parts are" if images else "text parts are"
            raise APIError(400, f"{where}.content[{j}]: only {allowed} supported, got {kind!r}", param="input")
        parts.append({"type": "text", "text": text})
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _image(part: dict, where: str) -> dict:
    """An `input_image` part as the chat `image_url` part it stands for (a data: URL; `detail` changes nothing)."""
    if part.get("file_id") is not None:
        raise APIError(400, f"{where}: images by file_id are not supported; send image_url, a data: URL", param="input")
    if part.get("detail") not in (None, "auto", "low", "high"):
        raise APIError(400, f"{where}.detail: must be auto, low or high", param="input")
    return image_url_part(part.get("image_url"), where, "input")


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"{where}.{key}: must be a string", param="input")
    return value


def _chat_tool(tool: dict, i: int) -> dict:
    if tool.get("type") != "function":
        raise APIError(400, f"tools[{i}]: only function tools are supported, got {tool.get('type')!r}", param="tools")
    keys = ("name", "description", "parameters", "strict")
    return {"type": "function", "function": {k: tool[k] for k in keys if tool.get(k) is not None}}


def _chat_tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise APIError(400, "tool_choice: must be none, auto, required or a function by name", param="tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(fmt: Any) -> dict:
    if not isinstance(fmt, dict):
        raise APIError(400, "text.format: must be an object", param="text")
    if fmt.get("type") == "json_schema":
        return {
            "type": "json_schema",
            "json_schema": {"name": fmt.get("name") or "output", "schema": fmt.get("schema")},
        }
    return {"type": fmt.get("type")}


class ResponsesBuilder(AnswerBuilder):
    """One Response: its output items built from the choice's answer as it grows (`AnswerStream`), every event
    numbered, the final Response stored when the request asked."""

    named_events = True

    def __init__(
        self,
        req: ResponsesRequest,
        model: str,
        reader: AnswerReader,
        conversation: list[dict],
        store: ResponseStore,
        owner: str | None,
        params: SamplingParams,
    ) -> None:
        """`conversation`: the chat messages this response answers, without its instructions."""
        self.id = f"resp_{uuid.uuid4().hex}"
        self.req, self.model, self.params = req, model, params
        self.conversation, self.store, self.owner = conversation, store, owner
        self.created_at = int(time.time())
        self.sequence_number = 0
        self.items: list[dict] = []  # output items, in output_index order
        self._stream = AnswerStream(reader)
        self._texts: dict[str, str] = {}  # the text so far of each open reasoning or message item, by item id
        self._reasoning: dict | None = None  # the items still open
        self._message: dict | None = None

    def response(self, finals: list[RequestOutput]) -> dict:
        self.delta_events(0, finals[0])
        return self._finish(finals[0])

    def first_events(self) -> list[dict]:
        snapshot = self._response("in_progress", [])
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def delta_events(self, prompt_index: int, out: RequestOutput) -> list[dict]:
        o = out.outputs[0]
        new = self._stream.update(o.text, o.finished, o.finish_reason == "length")
        events = []
        if new.reasoning:
            events += self._open_reasoning()
            events.append(self._text_delta("response.reasoning_text.delta", self._reasoning, new.reasoning))
        if new.content:
            events += self._close_reasoning() + self._open_message()
            events.append(self._text_delta("response.output_text.delta", self._message, new.content, logprobs=[]))
        for call in new.calls:
            events += self._close_reasoning() + self._call_events(call)
        if o.finished:
            events += self._close_reasoning() + self._close_message()
        return events

    def last_events(self, finals: list[RequestOutput | None]) -> list[dict]:
        response = self._finish(finals[0])
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return [self._event(kind, response=response)]

    def error_event(self, message: str) -> dict:
        return self._event("error", code="server_error", message=message, param=None)

    def _event(self, kind: str, **fields) -> dict:
        self.sequence_number += 1
        return {"type": kind, "sequence_number": self.sequence_number - 1, **fields}

    def _at(self, item: dict) -> dict:
        """The fields that place an event in `item`."""
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def _added(self, item: dict) -> dict:
        """`item` opened. Events hold copies: an item's fields are replaced, never changed in place, as it grows."""
        self.items.append(item)
        return self._event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item))

    def _done(self, item: dict, **fields) -> dict:
        item.update(status="completed", **fields)
        return self._event("response.output_item.done", output_index=self.items.index(item), item=dict(item))

    def _text_delta(self, kind: str, item: dict, delta: str, **fields) -> dict:
        self._texts[item["id"]] += delta
        return self._event(kind, **self._at(item), content_index=0, delta=delta, **fields)

    def _open_reasoning(self) -> list[dict]:
        if self._reasoning is not None:
            return []
        self._reasoning = {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [], "content": []}
        return self._open(self._reasoning)

    def _open_message(self) -> list[dict]:
        if self._message is not None:
            return []
        self._message = {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant", "content": []}
        part = _output_text("")
        return [
            *self._open(self._message),
            self._event("response.content_part.added", **self._at(self._message), content_index=0, part=part),
        ]

    def _open(self, item: dict) -> list[dict]:
        item["status"] = "in_progress"
        self._texts[item["id"]] = ""
        return [self._added(item)]

    def _close_reasoning(self) -> list[dict]:
        item, self._reasoning = self._reasoning, None
        if item is None:
            return []
        text = self._texts.pop(item["id"])
        done = self._event("response.reasoning_text.done", **self._at(item), content_index=0, text=text)
        return [done, self._done(item, content=[{"type": "reasoning_text", "text": text}])]

    def _close_message(self) -> list[dict]:
        item, self._message = self._message, None
        if item is None:
            return []
        text = self._texts.pop(item["id"])
        part = _output_text(text)
        return [
            self._event("response.output_text.done", **self._at(item), content_index=0, text=text, logprobs=[]),
            self._event("response.content_part.done", **self._at(item), content_index=0, part=part),
            self._done(item, content=[part]),
        ]

    def _call_events(self, call: ToolCall) -> list[dict]:
        item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call.id, "name": call.name}
        item.update(arguments="", status="in_progress")
        events = [self._added(item)]
        events.append(self._event("response.function_call_arguments.delta", **self._at(item), delta=call.arguments))
        events.append(
            self._event(
                "response.function_call_arguments.done", **self._at(item), name=call.name, arguments=call.arguments
            )
        )
        return [*events, self._done(item, arguments=call.arguments)]

    def _finish(self, final: RequestOutput) -> dict:
        """The final Response, stored with the conversation it ends when the request asked."""
        o = final.outputs[0]
        status = "incomplete" if o.finish_reason == "length" else "completed"
        response = self._response(status, [dict(item) for item in self.items], _usage(final))
        if status == "incomplete":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        if self.req.store:
            self.store.put(self.owner, response, [*self.conversation, self._assistant_message()])
        return response

    def _assistant_message(self) -> dict:
        """The output as the chat message a follow-up's history holds (without its reasoning, as templates drop it)."""
        text = "".join(p["text"] for item in self.items if item["type"] == "message" for p in item["content"])
        calls = [
            {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            for item in self.items
            if item["type"] == "function_call"
        ]
        return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}

    def _response(self, status: str, output: list[dict], usage: dict | None = None) -> dict:
        req = self.req
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": output,
            "usage": usage,
            "error": None,
            "incomplete_details": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "temperature": self.params.temperature,
            "top_p": self.params.top_p,
            "tools": req.tools or [],
            "tool_choice": req.tool_choice or "auto",
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "store": req.store,
            "text": req.text or {"format": {"type": "text"}},
            "truncation": "disabled",
            "metadata": req.metadata or {},
            "user": req.user,
        }


def _output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(final: RequestOutput) -> dict:
    o = final.outputs[0]
    prompt, output = len(final.prompt_token_ids), len(o.token_ids)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": o.num_reasoning_tokens},
        "total_tokens": prompt + output,
    }


async def create_response(
    serving: "OpenAIServing", req: ResponsesRequest, raw: Request, store: ResponseStore, owner: str | None
) -> "Answer":
    """`POST /responses` on `serving`, continuing `owner`'s stored `previous_response_id` if given."""
    history = []
    if req.previous_response_id is not None:
        previous = store.get(owner, req.previous_response_id)
        if previous is None:
            message = f"previous_response_id: no stored response {req.previous_response_id!r}"
            raise APIError(404, message, param="previous_response_id", code="response_not_found")
        history = await asyncio.to_thread(json.loads, previous.messages)
    conversation = history + input_messages(req.input)
    chat = chat_request(req, conversation, serving.engine.engine.reasoning is not None)
    engine = serving.engine
    if req.instructions is not None and len(req.instructions) > engine.engine.max_prompt_chars:  # not rendered
        raise _instructions_too_long(f"{len(req.instructions)} characters", engine.max_model_len)

    def builder(params: SamplingParams, reader: AnswerReader) -> ResponsesBuilder:
        return ResponsesBuilder(req, req.model or serving.model_name, reader, conversation, store, owner, params)

    try:
        return await serving.serve_chat(chat, raw, builder)
    except APIError as e:
        if e.param == "messages" and req.instructions:  # the instructions, alone, may be what does not fit
            tokens = await _num_tokens(engine, req.instructions)
            if tokens is not None and tokens >= engine.max_model_len:
                raise _instructions_too_long(f"{tokens} tokens", engine.max_model_len) from None
        raise e.renamed(FIELD_NAMES) from None


async def _num_tokens(engine: "AsyncLLMEngine", text: str) -> int | None:
    """How many tokens `text` is on its own (None if it cannot be tokenized); counted past the context too."""
    try:
        return len((await engine.tokenize({"prompt": text, "add_special_tokens": False}, fit_context=False)).token_ids)
    except ValueError:
        return None


def _instructions_too_long(size: str, max_model_len: int) -> APIError:
    message = f"instructions has {size}, more than the model's maximum context length of {max_model_len} tokens"
    return APIError(400, message, param="instructions")
