"""The OpenAI API's ways of asking for structured output, turned into one `StructuredOutputsParams`:
`response_format` (json_object, json_schema), vLLM's `structured_outputs` field, and the grammar that
`tool_choice` "required" or a named function implies; and `off_loop`, where servers check them.

Invariant: checking a request's structured outputs (jsonschema's checks, building its xgrammar grammar) never
runs on the event loop, and a server waits for it at most grammar_compile_timeout seconds."""

import asyncio
import dataclasses
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from tiffin.engine.errors import ParamError
from tiffin.engine.structured.params import StructuredOutputsParams
from tiffin.plugin.openai.tools import ChatTool, NamedToolChoice, ToolChoice, ToolParser, check_tools, chosen_tools

T = TypeVar("T")
# jsonschema's checks hold the GIL, so more threads would not check faster; two let a slow check (up to about a
# second within `tiffin.engine.structured.limits`) leave room for the next, apart from the tokenizing threads.
_CHECKS = ThreadPoolExecutor(2, thread_name_prefix="tiffin-structured-check")


async def off_loop(check: Callable[[], T], timeout: float, param: str) -> T:
    """`check()`, which checks a request's structured outputs, on a checking thread; ParamError naming `param`
    once it has taken `timeout` seconds (it then finishes unobserved, or never starts if still queued)."""
    try:
        return await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(_CHECKS, check), timeout)
    except TimeoutError:
        raise ParamError(
            param, f"{param}: checking it took longer than grammar_compile_timeout={timeout:g} s"
        ) from None


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str
    description: str | None = None
    json_schema: Any = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    json_schema: JsonSchemaSpec | None = None


def request_structured_outputs(
    response_format: ResponseFormat | None,
    structured_outputs: dict | None,
    tools: list[ChatTool] | None = None,
    tool_choice: ToolChoice | None = None,
    parallel_tool_calls: bool = True,
    parser: ToolParser | None = None,
) -> StructuredOutputsParams | None:
    """What the output must match, or None; ParamError naming the field at fault."""
    asked = {}
    if response_format is not None and response_format.type != "text":
        asked["response_format"] = lambda: _from_response_format(response_format)
    if structured_outputs is not None:
        asked["structured_outputs"] = lambda: from_fields(structured_outputs)
    if tools:
        try:
            check_tools(tools)
            forced = chosen_tools(tools, tool_choice or "auto")
        except ValueError as e:
            raise ParamError("tool_choice" if str(e).startswith("tool_choice") else "tools", str(e)) from None
        if forced is not None:  # a named function is called once
            parallel = parallel_tool_calls and not isinstance(tool_choice, NamedToolChoice)
            asked["tool_choice"] = lambda: parser.structural_tag(forced, parallel)
    elif tool_choice not in (None, "none", "auto"):
        raise ParamError("tool_choice", "tool_choice requires tools")
    if len(asked) > 1:
        raise ParamError(list(asked)[1], f"only one of {' / '.join(asked)} can constrain the output")
    for param, build in asked.items():
        try:
            return build()
        except ValueError as e:
            raise ParamError(param, f"{param}: {str(e).removeprefix('structured_outputs: ')}") from None
    return None


def as_field(e: ValueError, field: str | None) -> ValueError:
    """The engine's refusal of a grammar (a ParamError on `structured_outputs`), named after `field`, the request
    field that asked for the grammar (response_format, tools)."""
    if not isinstance(e, ParamError) or e.param != "structured_outputs" or field in (None, "structured_outputs"):
        return e
    return ParamError(field, f"{field}: {str(e).removeprefix('structured_outputs: ')}")


def _from_response_format(fmt: ResponseFormat) -> StructuredOutputsParams:
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise ValueError("type json_schema needs json_schema.schema")
        return StructuredOutputsParams(json=fmt.json_schema.json_schema)
    raise ValueError(f"unknown type {fmt.type!r}; supported: text, json_object, json_schema")


def from_fields(fields: dict) -> StructuredOutputsParams:
    """vLLM's `structured_outputs` request field; ValueError naming an unknown key."""
    known = {f.name for f in dataclasses.fields(StructuredOutputsParams) if f.init}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"unknown field {unknown[0]!r}; known: {', '.join(sorted(known))}")
    return StructuredOutputsParams(**fields)
