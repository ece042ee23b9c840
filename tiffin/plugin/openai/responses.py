"""The JSON of OpenAI responses and stream chunks: one builder class per endpoint, `CompletionResponses` for
/completions and `ChatResponses` for /chat/completions, both `ResponseBuilder`s.

Invariants:
- Choice `index` is `prompt index * n + output index`, streamed or not.
- A streamed choice sends each token's logprobs once, and nothing after the chunk that carries its
  finish_reason; its text deltas add up to the text of the non-streamed choice.
- A chat choice with tools holds back text that may still turn out to be a tool call (`ToolCallStream`), so
  its streamed content and calls add up to the non-streamed message.
- No NaN or infinity reaches the JSON: a non-finite logprob is sent as vLLM's floor, -9999.0."""

import math
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from tiffin.engine.outputs import CompletionOutput, Logprob, RequestOutput
from tiffin.plugin.openai.tools import ToolCallStream, ToolParser, assistant_message

LOGPROB_FLOOR = -9999.0


@dataclass
class _Sent:
    """What a stream choice has been sent so far."""

    chars: int = 0
    tokens: int = 0
    text_offset: int = 0  # completions logprobs: where the next token's text starts
    closed: bool = False


# a sampled token's logprob and the top alternatives at its position, best first
_TokenLogprobs = tuple[Logprob, list[Logprob]]


class ResponseBuilder(ABC):
    """The response or the stream chunks of one request: its id, creation time and model name, and how far each
    streamed choice has been sent. A builder serves one request; its subclasses are the endpoints."""

    id_prefix: ClassVar[str]
    object_type: ClassVar[str]
    chunk_object_type: ClassVar[str]

    def __init__(self, model: str, n: int, logprobs: int | None) -> None:
        """`n`: choices per prompt; `logprobs`: how many top alternatives each token lists, None for no logprobs."""
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.model, self.n, self.logprobs = model, n, logprobs
        self.created = int(time.time())
        self._sent: dict[int, _Sent] = {}

    def response(self, finals: list[RequestOutput]) -> dict:
        """The non-streamed response to the finished outputs of each prompt, in prompt order."""
        choices = []
        for i, final in enumerate(finals):
            for o in final.outputs:
                body, finish_reason = self._choice(o, self._logprobs(o, _Sent()))
                index = i * self.n + o.index
                choices.append({"index": index, **body, "finish_reason": finish_reason, "stop_reason": o.stop_reason})
        return {
            "id": self.id,
            "object": self.object_type,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": _usage(finals),
        }

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        return {
            "id": self.id,
            "object": self.chunk_object_type,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
        }

    def usage_chunk(self, finals: list[RequestOutput | None]) -> dict:
        """The last chunk of a stream that asked for `include_usage`."""
        return self.chunk([], usage=_usage(finals))

    def first_chunks(self) -> list[dict]:
        """What a stream sends before any output."""
        return []

    def delta_chunks(self, prompt_index: int, out: RequestOutput) -> list[dict]:
        """The chunks for what `out`, the newest output of prompt `prompt_index`, adds to what was sent."""
        chunks = []
        for o in out.outputs:
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
    `text_offset` lists."""

    id_prefix = "cmpl"
    object_type = "text_completion"
    chunk_object_type = "text_completion"

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
            "token_logprobs": [_finite(s.logprob) for s, _ in entries],
            "top_logprobs": [{t.decoded_token: _finite(t.logprob) for t in top} for _, top in entries],
            "text_offset": offsets,
        }


class ChatResponses(ResponseBuilder):
    """/chat/completions: choices carry an assistant `message` (a `delta` when streamed, each stream choice
    opened by one with the role), logprobs are a `content` list. With a `tool_parser` (the request has tools
    and tool_choice is not "none"), tool calls are parsed out of the text."""

    id_prefix = "chatcmpl"
    object_type = "chat.completion"
    chunk_object_type = "chat.completion.chunk"

    def __init__(self, model: str, n: int, logprobs: int | None, tool_parser: ToolParser | None = None) -> None:
        super().__init__(model, n, logprobs)
        self.tool_parser = tool_parser
        self._tool_streams: dict[int, ToolCallStream] = {}

    def first_chunks(self) -> list[dict]:
        opening = {"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return [self.chunk([{"index": i, **opening}]) for i in range(self.n)]

    def _choice(self, o: CompletionOutput, logprobs: dict | None) -> tuple[dict, str | None]:
        message, finish_reason = assistant_message(self.tool_parser, o.text, o.finish_reason)
        return {"message": message, "logprobs": logprobs}, finish_reason

    def _delta(self, index: int, o: CompletionOutput, text: str) -> tuple[dict, str | None]:
        if self.tool_parser is None:
            return {"delta": {"content": text}}, o.finish_reason if o.finished else None
        stream = self._tool_streams.setdefault(index, ToolCallStream(self.tool_parser))
        content, calls = stream.update(o.text, o.finished)
        delta = {"content": content, "tool_calls": calls} if calls else {"content": content}
        return {"delta": delta}, stream.finish_reason(o.finish_reason) if o.finished else None

    def _holds_back(self, body: dict) -> bool:
        return self.tool_parser is not None and not any(body["delta"].values())

    def _format_logprobs(self, entries: list[_TokenLogprobs], sent: _Sent) -> dict:
        def item(lp: Logprob) -> dict:
            return {"token": lp.decoded_token, "logprob": _finite(lp.logprob), "bytes": list(lp.decoded_token.encode())}

        return {"content": [{**item(s), "top_logprobs": [item(t) for t in top]} for s, top in entries]}


def _usage(finals: list[RequestOutput | None]) -> dict:
    """Token counts of the outputs so far; None stands for a prompt with no output yet."""
    prompt = sum(len(f.prompt_token_ids) for f in finals if f is not None)
    completion = sum(len(o.token_ids) for f in finals if f is not None for o in f.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR
