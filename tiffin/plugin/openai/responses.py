"""The JSON of answers and their streams: `AnswerBuilder`, what every endpoint's builder provides, and the two of
OpenAI's classic endpoints, `CompletionResponses` for /completions and `ChatResponses` for /chat/completions.

Invariants:
- Choice `index` is `prompt index * n + output index`, streamed or not.
- A streamed choice sends each token's logprobs once, and nothing after the chunk that carries its
  finish_reason; its text deltas add up to the text of the non-streamed choice.
- A chat choice is read by an `AnswerReader` (reasoning, content, tool calls), streamed through an `AnswerStream`,
  so its streamed reasoning, content and calls add up to the non-streamed message.
- No NaN or infinity reaches the JSON: a non-finite logprob is sent as vLLM's floor, -9999.0."""

import dataclasses
import json
import math
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from tiffin.engine.outputs import CompletionOutput, Logprob, RequestOutput
from tiffin.plugin.openai.answer import Answer, AnswerReader, AnswerStream

LOGPROB_FLOOR = -9999.0


@dataclass
class _Sent:
    """What a stream choice has been sent so far."""

    chars: int = 0
    tokens: int = 0
    text_offset: int = 0  # completions logprobs: where the next token's text starts
    closed: bool = False


# a sampled token's logprob and the top alternatives at its position, best first (None: an echoed prompt's first
# token, which has no position before it)
_TokenLogprobs = tuple[Logprob, list[Logprob] | None]


class AnswerBuilder(ABC):
    """The answer of one request to an endpoint: whole (`response`), or as server-sent events (`first_events`, then
    `delta_events` for each new output, then `last_events`; `error_event` in place of the rest when generation
    fails), each framed by `sse`, the stream ending with `stream_end`."""

    id: str
    stream_end: ClassVar[str] = ""
    named_events: ClassVar[bool] = False  # each event also names its `type` in an `event:` line (Responses, Messages)

    @abstractmethod
    def response(self, finals: list[RequestOutput]) -> dict:
        """The answer to the finished outputs of each prompt, in prompt order."""

    def first_events(self) -> list[dict]:
        return []

    @abstractmethod
    def delta_events(self, prompt_index: int, out: RequestOutput) -> list[dict]:
        """What `out`, the newest output of prompt `prompt_index`, adds to what was sent."""

    def last_events(self, finals: list[RequestOutput | None]) -> list[dict]:
        return []

    def error_event(self, message: str) -> dict:
        return {"error": {"message": message, "type": "server_error", "param": None, "code": None}}

    def sse(self, event: dict) -> str:
        """An event as a server-sent event: a data line (OpenAI's classic endpoints), after its name when named."""
        name = f"event: {event['type']}\n" if self.named_events else ""
        return f"{name}data: {json.dumps(event, ensure_ascii=False)}\n\n"


class ResponseBuilder(AnswerBuilder):
    """OpenAI's classic endpoints: an id, creation time and model name, choices, and how far each streamed choice has
    been sent. A builder serves one request; its subclasses are the endpoints."""

    id_prefix: ClassVar[str]
    object_type: ClassVar[str]
    chunk_object_type: ClassVar[str]
    stream_end = "data: [DONE]\n\n"
    decode: Callable[[list[int]], str] | None = None  # the tokenizer's, where prompts are echoed

    def __init__(self, model: str, n: int, logprobs: int | None, include_usage: bool = False) -> None:
        """`n`: choices per prompt; `logprobs`: how many top alternatives each token lists, None for no logprobs;
        `include_usage`: a stream ends with a usage chunk."""
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.model, self.n, self.logprobs, self.include_usage = model, n, logprobs, include_usage
        self.created = int(time.time())
        self._sent: dict[int, _Sent] = {}

    def response(self, finals: list[RequestOutput]) -> dict:
        """The non-streamed response to the finished outputs of each prompt, in prompt order."""
        choices = []
        for i, final in enumerate(finals):
            for o in self._outputs(i, final):
                body, finish_reason = self._choice(o, self._logprobs(o, _Sent()))
                index = i * self.n + o.index
                choice = {"index": index, **body, "finish_reason": finish_reason, "stop_reason": o.stop_reason}
                choices.append(choice | self._choice_prompt_logprobs(final))
        return {
            "id": self.id,
            "object": self.object_type,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": _usage(finals),
        } | self._response_prompt_logprobs(finals)

    def _outputs(self, prompt_index: int, out: RequestOutput) -> list[CompletionOutput]:
        """The choices of `out` as the endpoint sends them."""
        return out.outputs

    def _choice_prompt_logprobs(self, final: RequestOutput) -> dict:
        """vLLM's `prompt_logprobs` of a choice, where the endpoint puts them there and the request asked."""
        return {}

    def _response_prompt_logprobs(self, finals: list[RequestOutput]) -> dict:
        """vLLM's `prompt_logprobs` of a response, where the endpoint puts them there and the request asked."""
        return {}

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        return {
            "id": self.id,
            "object": self.chunk_object_type,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
        }

    def last_events(self, finals: list[RequestOutput | None]) -> list[dict]:
        return [self.chunk([], usage=_usage(finals))] if self.include_usage else []

    def delta_events(self, prompt_index: int, out: RequestOutput) -> list[dict]:
        chunks = []
        for o in self._outputs(prompt_index, out):
            index = prompt_index * self.n + o.index
            sent = self._sent.setdefault(index, _Sent())
            text = o.text[sent.chars :]
            new_tokens = len(o.token_ids) > sent.tokens
            if sent.closed or not (text or o.finished or (new_tokens and self.logprobs is not None)):
                continue
            lp = self._logprobs(o, sent)
            sent.chars, sent.tokens, sent.closed = len(o.text), len(o.token_ids), o.finished
            body, finish_reason = self._delta(index, o, text)
            if self._holds_back(body) and not (o.finished or lp):
                continue
            choice = {
                "index": index,
                **body,
                "logprobs": lp,
                "finish_reason": finish_reason,
                "stop_reason": o.stop_reason if o.finished else None,
            }
            chunks.append(self.chunk([choice]))
        return chunks

    def _logprobs(self, o: CompletionOutput, sent: _Sent) -> dict | None:
        """Logprobs of the tokens after `sent.tokens`, in the endpoint's shape."""
        if self.logprobs is None or o.logprobs is None:
            return None
        entries = []
        for token_id, alternatives in zip(o.token_ids[sent.tokens :], o.logprobs[sent.tokens :]):
            if alternatives is None:  # only an echoed prompt's first token (`CompletionResponses`)
                entries.append((Logprob(math.nan, 0, self.decode([token_id])), None))
                continue
            top = sorted(alternatives.values(), key=lambda lp: lp.rank)[: self.logprobs]
            entries.append((alternatives[token_id], top))
        return self._format_logprobs(entries, sent)

    def _holds_back(self, body: dict) -> bool:
        """Whether a delta `body` says nothing yet, so that a chunk is sent only to finish or carry logprobs."""
        return False

    @abstractmethod
    def _choice(self, o: CompletionOutput, logprobs: dict | None) -> tuple[dict, str | None]:
        """A finished choice's body (text or message, and logprobs) and its finish_reason."""

    @abstractmethod
    def _delta(self, index: int, o: CompletionOutput, text: str) -> tuple[dict, str | None]:
        """A streamed choice's body for its new `text`, and its finish_reason (None until it finishes)."""

    @abstractmethod
    def _format_logprobs(self, entries: list[_TokenLogprobs], sent: _Sent) -> dict:
        """Logprobs of new tokens as the endpoint sends them; may advance `sent.text_offset`."""


class CompletionResponses(ResponseBuilder):
    """/completions: choices carry `text`, logprobs are `tokens` / `token_logprobs` / `top_logprobs` /
    `text_offset` lists; with `echo`, each choice starts with its prompt, text and tokens, as OpenAI's (the first
    token's logprob and top_logprobs null: no position before it). vLLM's `prompt_logprobs` per choice."""

    id_prefix = "cmpl"
    object_type = "text_completion"
    chunk_object_type = "text_completion"

    def __init__(
        self,
        model: str,
        n: int,
        logprobs: int | None,
        include_usage: bool = False,
        echo: Callable[[list[int]], str] | None = None,
    ) -> None:
        """`echo`: the tokenizer's decode, to echo the prompts (None: no echo)."""
        super().__init__(model, n, logprobs, include_usage)
        self.decode = echo
        self._prompts: dict[int, str] = {}  # each prompt's text, decoded once

    def _outputs(self, prompt_index: int, out: RequestOutput) -> list[CompletionOutput]:
        if self.decode is None:
            return out.outputs
        if prompt_index not in self._prompts:
            self._prompts[prompt_index] = out.prompt if out.prompt is not None else self.decode(out.prompt_token_ids)
        text, ids, prompt_lps = self._prompts[prompt_index], out.prompt_token_ids, out.prompt_logprobs
        return [
            dataclasses.replace(
                o,
                text=text + o.text,
                token_ids=ids + o.token_ids,
                logprobs=None if o.logprobs is None or prompt_lps is None else prompt_lps + o.logprobs,
            )
            for o in out.outputs
        ]

    def _choice_prompt_logprobs(self, final: RequestOutput) -> dict:
        return {} if final.prompt_logprobs is None else {"prompt_logprobs": prompt_logprobs_json(final)}

    def _choice(self, o: CompletionOutput, logprobs: dict | None) -> tuple[dict, str | None]:
        return {"text": o.text, "logprobs": logprobs}, o.finish_reason

    def _delta(self, index: int, o: CompletionOutput, text: str) -> tuple[dict, str | None]:
        return {"text": text}, o.finish_reason if o.finished else None

    def _format_logprobs(self, entries: list[_TokenLogprobs], sent: _Sent) -> dict:
        offsets = []
        for s, _ in entries:
            offsets.append(sent.text_offset)
            sent.text_offset += len(s.decoded_token)
        return {
            "tokens": [s.decoded_token for s, _ in entries],
            "token_logprobs": [None if top is None else _finite(s.logprob) for s, top in entries],
            "top_logprobs": [
                None if top is None else {t.decoded_token: _finite(t.logprob) for t in top} for _, top in entries
            ],
            "text_offset": offsets,
        }


class ChatResponses(ResponseBuilder):
    """/chat/completions: choices carry an assistant `message` (a `delta` when streamed, each stream choice
    opened by one with the role), logprobs are a `content` list. The `reader` splits a thinking model's reasoning
    out (`reasoning_content`, vLLM's field) and, when the request has tools and tool_choice is not "none", parses
    tool calls out of the content."""

    id_prefix = "chatcmpl"
    object_type = "chat.completion"
    chunk_object_type = "chat.completion.chunk"

    def __init__(
        self,
        model: str,
        n: int,
        logprobs: int | None,
        include_usage: bool = False,
        reader: AnswerReader | None = None,
    ) -> None:
        super().__init__(model, n, logprobs, include_usage)
        self.reader = reader or AnswerReader()
        self._streams: dict[int, AnswerStream] = {}

    def first_events(self) -> list[dict]:
        opening = {"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return [self.chunk([{"index": i, **opening}]) for i in range(self.n)]

    def _choice(self, o: CompletionOutput, logprobs: dict | None) -> tuple[dict, str | None]:
        answer = self.reader.read(o.text, cut=o.finish_reason == "length")
        message = {"role": "assistant", **self._parts(answer)}
        if answer.calls:
            message["content"] = answer.content or None
        return {"message": message, "logprobs": logprobs}, _finish_reason(answer.calls, o.finish_reason)

    def _delta(self, index: int, o: CompletionOutput, text: str) -> tuple[dict, str | None]:
        stream = self._streams.setdefault(index, AnswerStream(self.reader))
        new = stream.update(o.text, o.finished, o.finish_reason == "length")
        delta = self._parts(new, first_call=len(stream.calls) - len(new.calls))
        return {"delta": delta}, _finish_reason(stream.calls, o.finish_reason) if o.finished else None

    def _parts(self, answer: Answer, first_call: int | None = None) -> dict:
        """A message's content, and its reasoning and tool calls where it has them; a delta's (`first_call`: the
        index of its first call in the choice) sends each call as its id and name, then its arguments."""
        parts = {"content": answer.content}
        if answer.reasoning:
            parts["reasoning_content"] = answer.reasoning
        if answer.calls and first_call is None:
            parts["tool_calls"] = [c.to_openai() for c in answer.calls]
        elif answer.calls:
            parts["tool_calls"] = [
                delta
                for index, call in enumerate(answer.calls, first_call)
                for delta in (
                    {**call.to_openai(), "index": index, "function": {"name": call.name, "arguments": ""}},
                    {"index": index, "function": {"arguments": call.arguments}},
                )
            ]
        return parts

    def _response_prompt_logprobs(self, finals: list[RequestOutput]) -> dict:
        asked = finals and finals[0].prompt_logprobs is not None
        return {"prompt_logprobs": prompt_logprobs_json(finals[0])} if asked else {}

    def _holds_back(self, body: dict) -> bool:
        readers = self.reader.tool_parser is not None or self.reader.markers is not None
        return readers and not any(body["delta"].values())

    def _format_logprobs(self, entries: list[_TokenLogprobs], sent: _Sent) -> dict:
        def item(lp: Logprob) -> dict:
            return {"token": lp.decoded_token, "logprob": _finite(lp.logprob), "bytes": list(lp.decoded_token.encode())}

        return {"content": [{**item(s), "top_logprobs": [item(t) for t in top]} for s, top in entries]}


def prompt_logprobs_json(final: RequestOutput) -> list[dict | None]:
    """vLLM's JSON of `final.prompt_logprobs`: per prompt token null (the first) or {token id: its Logprob}."""
    as_json = lambda lp: {"logprob": _finite(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
    return [None if entry is None else {t: as_json(lp) for t, lp in entry.items()} for entry in final.prompt_logprobs]


def _finish_reason(calls: list, finish_reason: str | None) -> str | None:
    """A choice that called tools and stopped by itself finishes with "tool_calls"."""
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


def _usage(finals: list[RequestOutput | None]) -> dict:
    """Token counts of the outputs so far; None stands for a prompt with no output yet."""
    prompt = sum(len(f.prompt_token_ids) for f in finals if f is not None)
    completion = sum(len(o.token_ids) for f in finals if f is not None for o in f.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR
