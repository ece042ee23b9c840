"""OpenAI tool calling: the tool-call conventions of chat templates, parsed from output and enforced by grammar.

A parser knows one convention: Hermes (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, used by
the Qwen2.5/Qwen3/SmolLM2 templates) or Llama 3.x's JSON form (the whole message is `{"name": ...,
"parameters": {...}}`, several joined by `;`). `tool_choice` "required" or a named function turns the
convention into a structural tag (xgrammar), so the output is nothing but valid calls whose arguments match
each function's `parameters` schema; "auto" parses whatever the model wrote.

Streamed and non-streamed results are the same by construction: both come from `parse(text, final)`, which on
a partial text holds back whatever could still turn out to be a call (an open tag, a prefix of one, a
message that may be a Llama JSON call) and trailing whitespace, so that what it has returned only grows.

A call cut off by the token limit (`parse(text, cut=True)`: the output ended at max_tokens) is dropped, not returned
as text: what a streamed answer held back as a possible call stays unsent, so streamed and whole answers agree, and
the finish reason (`length`, `max_tokens`, `incomplete`) says why the call is missing."""

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from tiffin.engine.sampling_params import partial_prefix_len
from tiffin.engine.structured.params import StructuredOutputsParams, check_json_schema
from tiffin.plugin.openai import json_values


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolParser:
    """One chat template family's tool-call convention. `begin(name)` and `end` wrap one call's arguments."""

    name: str
    separator: str  # between calls, when a grammar writes several
    end: str

    def parse(self, text: str, final: bool = True, cut: bool = False) -> tuple[str, list[ToolCall]]:
        """(content, calls) of `text`; with final=False, only what later text cannot change; with cut (the text
        ended at the token limit), without the call it was cut off in."""
        raise NotImplementedError

    def begin(self, function: str) -> str:
        raise NotImplementedError

    def structural_tag(self, tools: list[ChatTool], parallel: bool) -> StructuredOutputsParams:
        """Output made only of calls to `tools` (at least one; exactly one unless `parallel`)."""
        tags = [
            {
                "type": "tag",
                "begin": self.begin(t.function.name),
                "content": {"type": "json_schema", "json_schema": parameters_schema(t.function)},
                "end": self.end,
            }
            for t in tools
        ]
        return StructuredOutputsParams(
            structural_tag={
                "type": "structural_tag",
                "format": {
                    "type": "tags_with_separator",
                    "tags": tags,
                    "separator": self.separator,
                    "at_least_one": True,
                    "stop_after_first": not parallel,
                },
            }
        )


class HermesToolParser(ToolParser):
    name = "hermes"
    separator = "\n"
    end = "}\n</tool_call>"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def begin(self, function: str) -> str:
        return f'{self.OPEN}\n{{"name": {json.dumps(function, ensure_ascii=False)}, "arguments": '

    def parse(self, text: str, final: bool = True, cut: bool = False) -> tuple[str, list[ToolCall]]:
        content, calls, pos = [], [], 0
        while (start := text.find(self.OPEN, pos)) >= 0:
            stop = text.find(self.CLOSE, start)
            if stop < 0:
                break
            content.append(text[pos:start])
            block = text[start : stop + len(self.CLOSE)]
            call = _call(text[start + len(self.OPEN) : stop], "arguments")
            if call is None:
                content.append(block)
            else:
                calls.append(call)
            pos = stop + len(self.CLOSE)
        tail = text[pos:]
        if not final or cut:  # an open tag, or what may become one, is not content (yet, or ever once cut off)
            open_at = tail.find(self.OPEN)
            tail = tail[:open_at] if open_at >= 0 else tail[: len(tail) - partial_prefix_len(tail, self.OPEN)]
        content.append(tail)
        return "".join(content).strip(), calls


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    separator = "; "
    end = "}"
    PYTHON_TAG = "<|python_tag|>"

    def begin(self, function: str) -> str:
        return f'{{"name": {json.dumps(function, ensure_ascii=False)}, "parameters": '

    def parse(self, text: str, final: bool = True, cut: bool = False) -> tuple[str, list[ToolCall]]:
        body = text.lstrip().removeprefix(self.PYTHON_TAG)
        maybe_calls = body.lstrip().startswith("{") or self.PYTHON_TAG.startswith(text.lstrip())
        if not maybe_calls:
            return text.strip(), []
        if not final:  # the message is calls only if all of it parses: wait for the end
            return "", []
        calls = _json_calls(body)
        if not calls and cut and self._may_be_call(text):  # a call cut off: nothing of it is content
            return "", []
        return ("", calls) if calls else (text.strip(), [])

    def _may_be_call(self, text: str) -> bool:
        """Whether `text` begins as a call does: the python tag, or an object whose first key is (or may be) name."""
        stripped = text.lstrip()
        if stripped.startswith(self.PYTHON_TAG):
            return True
        rest = stripped.removeprefix("{").lstrip()
        return rest.startswith('"name"') or '"name"'.startswith(rest)


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser)}


def parser_for_template(chat_template: str | None) -> ToolParser:
    """The convention a chat template teaches its model; Hermes when the template shows none."""
    template = chat_template or ""
    if "<|python_tag|>" in template or '"parameters": dictionary of argument name' in template:
        return Llama3JsonToolParser()
    return HermesToolParser()


def make_parser(setting: str, chat_template: str | None) -> ToolParser:
    """`setting`: "auto" (from the chat template) or a name in TOOL_PARSERS."""
    if setting == "auto":
        return parser_for_template(chat_template)
    if setting not in TOOL_PARSERS:
        raise ValueError(f"tool_parser must be 'auto' or one of {', '.join(TOOL_PARSERS)}, got {setting!r}")
    return TOOL_PARSERS[setting]()


def parameters_schema(function: FunctionDefinition) -> dict:
    return function.parameters if function.parameters is not None else {"type": "object", "properties": {}}


def check_tools(tools: list[ChatTool]) -> None:
    """ValueError naming the function whose name repeats or whose parameters cannot be enforced."""
    seen = set()
    for tool in tools:
        name = tool.function.name
        if name in seen:
            raise ValueError(f"tools: function name {name!r} is used twice")
        seen.add(name)
        try:
            check_json_schema(parameters_schema(tool.function))
        except ValueError as e:
            raise ValueError(f"tools: function {name!r} parameters: {e}") from None


def chosen_tools(tools: list[ChatTool], choice: ToolChoice) -> list[ChatTool] | None:
    """The tools a grammar must restrict the output to (None: no grammar, for "none" and "auto")."""
    if isinstance(choice, NamedToolChoice):
        named = [t for t in tools if t.function.name == choice.function.name]
        if not named:
            raise ValueError(f"tool_choice: no function named {choice.function.name!r} in tools")
        return named
    return tools if choice == "required" else None


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI history as chat templates read it: a call's arguments as a mapping (OpenAI sends JSON text), and
    no null content (an assistant turn that only called tools). ValueError naming the message and call whose
    `tool_calls` is not a list of function calls, each with a name and arguments that are a JSON object."""
    for i, m in enumerate(messages):
        if m.get("content") is None:
            m["content"] = ""
        calls = m.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            raise ValueError(f"messages[{i}].tool_calls: must be a list of tool calls")
        for j, call in enumerate(calls or ()):
            where = f"messages[{i}].tool_calls[{j}]"
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ValueError(f"{where}: must be an object whose function has a name, a string")
            if "arguments" in function:
                function["arguments"] = _arguments(function["arguments"], f"{where}.function.arguments")
    return messages


def _arguments(arguments: Any, where: str) -> dict:
    if isinstance(arguments, str):
        arguments = json_values.loads(arguments, where)
    if not isinstance(arguments, dict):
        raise ValueError(f"{where}: must be a JSON object")
    return arguments


def _call(text: str, arguments_key: str) -> ToolCall | None:
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    return _to_call(obj, arguments_key)


def _to_call(obj: Any, arguments_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if not isinstance(arguments, dict):
        return None
    try:  # what no chat history would take back (too deep, a lone surrogate) is text, not a call
        json_values.check_value(arguments, "arguments")
    except ValueError:
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _json_calls(text: str) -> list[ToolCall]:
    """Calls of a message that is nothing but JSON call objects separated by `;`; [] if it is anything else."""
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while True:
        pos = len(text) - len(text[pos:].lstrip())
        if pos == len(text):
            return calls
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except (json.JSONDecodeError, RecursionError):
            return []
        call = _to_call(obj, "parameters")
        if call is None:
            return []
        calls.append(call)
        rest = text[pos:].lstrip()
        if rest.startswith(";"):
            pos = len(text) - len(rest) + 1
        elif rest:
            return []
