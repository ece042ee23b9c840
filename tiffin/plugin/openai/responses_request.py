"""The Responses API's request (`ResponsesRequest`) and its translation into the chat completion request that runs
it (`chat_request`, on the chat messages `input_messages` makes of its input items); responses_api runs it and
answers.

Invariants:
- What a Response echoes is bounded as OpenAI's API bounds it: `metadata` (16 keys of at most 64 characters,
  values of at most 512), and an unknown field inside a function tool, `tool_choice`, `text` or `text.format` is
  refused by name, never echoed or stored.
- Fields of OpenAI's API that are not implemented (`UNSUPPORTED`, `background`) are refused by name when given; a
  field the chat request refuses is named as the Responses API names it (`FIELD_NAMES`)."""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

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
