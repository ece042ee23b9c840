"""The OpenAI API's ways of asking for structured output, turned into one `StructuredOutputsParams`:
`response_format` (json_object, json_schema), vLLM's `structured_outputs` field, and the grammar that
`tool_choice` "required" or a named function implies."""

import dataclasses
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tiffin.engine.errors import ParamError
from tiffin.engine.structured.params import StructuredOutputsParams
from tiffin.plugin.openai.tools import ChatTool, NamedToolChoice, ToolChoice, ToolParser, check_tools, chosen_tools


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
