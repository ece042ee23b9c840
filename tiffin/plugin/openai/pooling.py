"""`PoolingServing`: /embeddings, /score and /rerank on an `AsyncLLMEngine` whose model embeds or scores pairs.

Invariants:
- Each input (each text, document or pair) is one engine request, all running concurrently. Every input is
  tokenized and checked before any is queued, so a refused one fails the request with nothing run; once they are
  queued, the first failure (a full queue, a failed step) or a client's disconnect cancels the others, whose engine
  requests abort: nothing keeps running for a request that has been answered.
- A refusal names the request field at fault: the input's own (`input`, `text_2`, `documents`, `query`, with its
  index when there are several) when the input was refused (too long, bad token ids), else the setting the engine
  named (`dimensions`, `truncate_prompt_tokens`, ...).
- `encoding_format: "base64"` is the little-endian float32 bytes of exactly the floats `"float"` sends.
- A response body is serialized on a worker thread: 2,048 embeddings of 1,024 floats are megabytes of JSON, which
  on the event loop would stall every stream."""

import asyncio
import base64
import struct
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request, Response

from tiffin.engine.errors import EngineError, ParamError, QueueFull
from tiffin.engine.outputs import PoolingRequestOutput
from tiffin.engine.pooling_params import PoolingParams
from tiffin.plugin.openai.encoding import json_response
from tiffin.plugin.openai.protocol import APIError, EmbeddingRequest, RerankRequest, ScoreRequest
from tiffin.plugin.openai.serving import model_card, unless_disconnected

if TYPE_CHECKING:  # torch, which `bentoml build` need not import
    from tiffin.engine.async_llm_engine import AsyncLLMEngine

# What a model of each engine task serves: an embedding model scores pairs by the cosine of their embeddings, a
# cross-encoder ("classify") by its classifier. /score and /rerank need "score".
TASKS = {"generate": ("generate",), "embed": ("embed", "score"), "classify": ("classify", "score")}
# engine ParamError params that name the input itself, which the API names by its own field
_INPUT_PARAMS = {"prompt", "prompt_token_ids"}
SCORE_FIELDS = ("text_1", "text_2")  # the request fields of the texts scored, first and second
RERANK_FIELDS = ("query", "documents")


@dataclass(frozen=True)
class _Pair:
    """Two texts a cross-encoder reads as one input."""

    text_1: str
    text_2: str


@dataclass(frozen=True)
class _Messages:
    """A conversation embedded as one input (`InputProcessor.tokenize_messages`)."""

    messages: list


class PoolingServing:
    """The pooling endpoints of one engine."""

    def __init__(self, engine: "AsyncLLMEngine", model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.created = int(time.time())

    @property
    def tasks(self) -> tuple[str, ...]:
        return TASKS[self.engine.task]

    def serves(self, model: str) -> bool:
        return model == self.model_name

    def models(self) -> dict:
        return {"object": "list", "data": [model_card(self)]}

    async def embeddings(self, req: EmbeddingRequest, raw: Request) -> Response:
        params = req.params()
        if req.messages is None:
            pooled = self.encode(req.inputs(), params, "input")
        else:  # one conversation, one embedding
            pooled = self._pool([("messages", "messages", _Messages(req.messages))], params)
        outputs = await unless_disconnected(raw, pooled)
        encode = _base64 if req.encoding_format == "base64" else list
        tokens = sum(len(o.prompt_token_ids) for o in outputs)
        return await json_response(
            {
                "id": f"embd-{uuid.uuid4().hex}",
                "object": "list",
                "created": int(time.time()),
                "model": req.model or self.model_name,
                "data": [
                    {"object": "embedding", "index": i, "embedding": encode(o.outputs.embedding)}
                    for i, o in enumerate(outputs)
                ],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    async def score(self, req: ScoreRequest, raw: Request) -> Response:
        firsts, seconds = req.texts()
        params = req.pooling_params(self.engine.task)
        scores, tokens = await unless_disconnected(raw, self.scores(firsts, seconds, params))
        return await json_response(
            {
                "id": f"score-{uuid.uuid4().hex}",
                "object": "list",
                "created": int(time.time()),
                "model": req.model or self.model_name,
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
            }
        )

    async def rerank(self, req: RerankRequest, raw: Request) -> Response:
        texts = req.texts()
        params = req.pooling_params(self.engine.task)
        scores, tokens = await unless_disconnected(raw, self.scores([req.query], texts, params, RERANK_FIELDS))
        return await json_response(
            {
                "id": f"rerank-{uuid.uuid4().hex}",
                "model": req.model or self.model_name,
                "results": ranked(texts, scores, req.top_n, req.return_documents is not False),
                "usage": {"total_tokens": tokens},
            }
        )

    async def encode(self, prompts: list, params: PoolingParams, field: str) -> list[PoolingRequestOutput]:
        """The engine's output for each prompt, in order; APIError naming `field` (the request field holding the
        prompts) or the parameter the engine refused."""
        return await self._pool([(field, _where(field, i, len(prompts)), p) for i, p in enumerate(prompts)], params)

    async def scores(
        self,
        firsts: list[str],
        seconds: list[str],
        params: PoolingParams,
        fields: tuple[str, str] = SCORE_FIELDS,
    ) -> tuple[list[float], int]:
        """The score of each text of `seconds` against its text of `firsts` (one for all, or one each), as the
        engine's `score` gives it, and the tokens the model read for them: a cross-encoder reads each pair, an
        embedding model each distinct text once (the cosine of two embeddings is the pair's score)."""
        pairs = list(zip(firsts * len(seconds) if len(firsts) == 1 else firsts, seconds))
        if self.engine.task == "classify":
            inputs = [(fields[1], _where(fields[1], i, len(seconds)), _Pair(a, b)) for i, (a, b) in enumerate(pairs)]
            outputs = await self._pool(inputs, params, dict(zip(("text_1", "text_2"), fields)))
            return [o.outputs.score for o in outputs], sum(len(o.prompt_token_ids) for o in outputs)
        from tiffin.engine.scoring import cosine_scores  # torch, which `bentoml build` need not import

        unique: dict[str, tuple[str, str]] = {}  # text -> (field, where) of its first place
        for field, texts in zip(fields, (firsts, seconds)):
            for i, text in enumerate(texts):
                unique.setdefault(text, (field, _where(field, i, len(texts))))
        outputs = await self._pool([(field, where, text) for text, (field, where) in unique.items()], params)
        embedded = dict(zip(unique, outputs))
        scored = cosine_scores(
            [str(i) for i in range(len(pairs))], *zip(*((embedded[a], embedded[b]) for a, b in pairs))
        )
        return [o.outputs.score for o in scored], sum(len(o.prompt_token_ids) for o in outputs)

    async def _pool(
        self, inputs: list[tuple[str, str, Any]], params: PoolingParams, renames: dict[str, str] | None = None
    ) -> list[PoolingRequestOutput]:
        """Each (field, where, prompt or _Pair) pooled. Every input is tokenized and checked first, on one worker
        thread, so that a refused one (an APIError naming `field` and `where`, or the engine parameter at fault, as
        `renames` spells it in the API) fails the request before any is queued; then all run at once, and the
        first failure among them (a full queue, a failed step) cancels the rest."""
        renames = renames or {}
        engine = self.engine.engine  # its tokenize and tokenize_pair are thread-safe

        def tokenize_all() -> list:
            prompts = []
            for field, where, prompt in inputs:
                try:
                    if isinstance(prompt, _Pair):  # with its token types
                        prompts.append(engine.tokenize_pair(prompt.text_1, prompt.text_2, params))
                    elif isinstance(prompt, _Messages):
                        prompts.append(engine.tokenize_messages(prompt.messages, params))
                    else:
                        prompts.append(engine.tokenize(prompt, params))
                except ValueError as e:
                    raise _refusal(e, field, where, renames) from None
            return prompts

        request_id = f"pool-{uuid.uuid4().hex}"

        async def one(i: int, field: str, where: str, prompt) -> PoolingRequestOutput:
            try:
                out = await self.engine.encode(prompt, params, f"{request_id}-{i}")
            except (ValueError, QueueFull, EngineError) as e:
                raise _refusal(e, field, where, renames) from None
            if out.error is not None or out.outputs is None:
                raise APIError(500, f"{where}: {out.error}", type="server_error")
            return out

        prompts = await self.engine.tokenizing.run(tokenize_all)  # not in the default executor: it parses bodies
        return await all_or_none([one(i, f, w, p) for i, ((f, w, _), p) in enumerate(zip(inputs, prompts))])


def ranked(texts: list[str], scores: list[float], top_n: int | None, documents: bool) -> list[dict]:
    """Rerank results, most relevant first (ties in document order), the first `top_n` (None or 0: all)."""
    order = sorted(range(len(texts)), key=lambda i: -scores[i])[: top_n or None]
    return [
        {"index": i, "relevance_score": scores[i], **({"document": {"text": texts[i]}} if documents else {})}
        for i in order
    ]


async def all_or_none(calls: list[Awaitable]) -> list:
    """The results of `calls`, run concurrently; the first to raise cancels the others (whose engine requests
    abort) and is raised, as is a cancellation of the caller."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # they have let go of their engine requests


def _refusal(e: ValueError | QueueFull | EngineError, field: str, where: str, renames: dict[str, str]) -> APIError:
    """An engine refusal or failure of the input `where` of `field` as the request's APIError: a refused input
    names `field` (or what `renames` maps the engine's param to), a refused parameter itself."""
    param = getattr(e, "param", None)
    if isinstance(e, ParamError) and param not in _INPUT_PARAMS and param not in renames:
        return APIError(400, str(e), param=param)
    if isinstance(e, ValueError):
        return APIError(400, f"{where}: {e}", param=renames.get(param, field))
    if isinstance(e, QueueFull):
        return APIError(429, str(e), type="rate_limit_error", code="queue_full")
    return APIError(500, f"{where}: {e}", type="server_error")


def _where(field: str, i: int, count: int) -> str:
    """How an error names input `i` of `count` in `field`."""
    return field if count == 1 else f"{field}[{i}]"


def _base64(embedding: list[float]) -> str:
    """OpenAI's base64 encoding: little-endian float32 bytes, which its client reads with numpy.frombuffer."""
    return base64.b64encode(struct.pack(f"<{len(embedding)}f", *embedding)).decode("ascii")
