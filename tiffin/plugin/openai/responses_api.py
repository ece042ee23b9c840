"""OpenAI's Responses API (`POST /responses`, `GET` and `DELETE /responses/{id}`) over the chat path: a request is
translated into a chat completion request (responses_request: the request, its bounds and its translation), run by
`OpenAIServing.serve_chat`, and answered as a Response, or as its stream of events (`ResponsesBuilder`).

Invariants:
- The output items of a Response are, in order: a `reasoning` item when the model thought, a `message` once it has
  text, and a `function_call` item per tool call, each sent whole once complete. A stream's items, deltas and final
  Response add up to the non-streamed Response of the same output.
- `previous_response_id` continues the conversation a stored response ended (its input and output, not its
  instructions, as OpenAI's API does); a response is stored (`store`, true by default) for its owner only
  (tiffin.plugin.openai.store).
- A refused field is named as the Responses API names it (`input`, `text`, `max_output_tokens`, `instructions`
  when they alone exceed the context), not as the chat request it was translated into."""

import asyncio
import json
import time
import uuid
from typing import TYPE_CHECKING

from fastapi import Request

from tiffin.engine.outputs import RequestOutput
from tiffin.engine.sampling_params import SamplingParams
from tiffin.plugin.openai.answer import AnswerReader, AnswerStream
from tiffin.plugin.openai.protocol import APIError
from tiffin.plugin.openai.responses import AnswerBuilder
from tiffin.plugin.openai.responses_request import FIELD_NAMES, ResponsesRequest, chat_request, input_messages
from tiffin.plugin.openai.store import ResponseStore
from tiffin.plugin.openai.tools import ToolCall

if TYPE_CHECKING:
    from tiffin.engine.async_llm_engine import AsyncLLMEngine
    from tiffin.plugin.openai.serving import Answer, OpenAIServing


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
