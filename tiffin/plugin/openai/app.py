"""The OpenAI-compatible FastAPI app: routes onto the servings of one or more engines (a chat model, an embedding
model beside it), and OpenAI's error shape for every failure.

Invariants:
- Every error response, a validation failure, an unknown route or an unexpected exception included, is OpenAI's
  `{"error": {"message", "type", "param", "code"}}`, a refused field named in `param`; on the Messages API's
  paths (/messages, /messages/count_tokens) it is Anthropic's `{"type": "error", "error": {"type", "message"}}`,
  the field named in the message.
- A request goes to the serving its `model` names, or to the first that can do what its endpoint needs
  (`ModelRouter`); a model asked for what it cannot do is a 400 naming its tasks.
- Until the servings are attached every route answers 503, and so does a route whose engine is dead or shut down.
- A 429 (the engine's waiting queue is full) carries `Retry-After`.
- A request body is parsed and validated off the event loop (`_body`), as FastAPI would (the same refusals):
  a body of megabytes takes a fifth of a second, which on the loop would stall every stream and probe."""

import asyncio
import email.message
import functools
import json
from collections.abc import Sequence
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from tiffin.engine.errors import EngineAsleep
from tiffin.plugin.openai import responses_api
from tiffin.plugin.openai.batches import BatchSettings, batch_routes
from tiffin.plugin.openai.clients import client_of
from tiffin.plugin.openai.encoding import json_bytes_response
from tiffin.plugin.openai.messages import (
    CountTokensRequest,
    MessagesRequest,
    count_tokens,
    error_body,
    serve_messages,
)
from tiffin.plugin.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    RerankRequest,
    ScoreRequest,
    UnloadLoRAAdapterRequest,
)
from tiffin.plugin.openai.responses_request import ResponsesRequest
from tiffin.plugin.openai.routing import ModelRouter, Serving
from tiffin.plugin.openai.store import ResponseStore
from tiffin.plugin.openai.tokenize import (
    MAX_TOKENIZE_IDS,
    DetokenizeRequest,
    TokenizeRequest,
    detokenize,
    tokenize,
)

Body = TypeVar("Body", bound=BaseModel)


def create_app(
    servings: Serving | Sequence[Serving] | None = None,
    response_store: ResponseStore | None = None,
    max_tokenize_ids: int = MAX_TOKENIZE_IDS,
    batches: BatchSettings | None = None,
) -> FastAPI:
    """The app over `servings` (one per engine). Without any its routes answer 503 until `attach_serving` hands
    them over: the Bento's app exists from import on (`@bentoml.asgi_app`), its engines only once loaded.
    `response_store`: where the Responses API keeps responses (default: `ResponseStore()`'s bounds).
    `max_tokenize_ids`: the most ids one /tokenize answers or /detokenize decodes. `batches`: the Batch API's
    settings (/files and /batches; off without a batch_dir)."""
    app = FastAPI(title="tiffin OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.max_tokenize_ids = max_tokenize_ids
    attach_serving(app, servings)
    store = response_store or ResponseStore()

    router = functools.partial(_router, app)
    ready = functools.partial(_ready, app)

    # no return annotations on routes: FastAPI would read them as response models
    @app.get("/models")
    async def models():
        for serving in router().servings:
            _check_healthy(serving)
        return router().models()

    @app.post("/completions")
    async def completions(raw: Request):
        req = await _body(raw, CompletionRequest)
        return await ready(raw, req.model, "generate").completions(req, raw)

    @app.post("/chat/completions")
    async def chat_completions(raw: Request):
        req = await _body(raw, ChatCompletionRequest)
        return await ready(raw, req.model, "generate").chat(req, raw)

    @app.post("/embeddings")
    async def embeddings(raw: Request):
        req = await _body(raw, EmbeddingRequest)
        return await ready(raw, req.model, "embed").embeddings(req, raw)

    @app.post("/score")
    async def score(raw: Request):
        req = await _body(raw, ScoreRequest)
        return await ready(raw, req.model, "score").score(req, raw)

    @app.post("/rerank")
    async def rerank(raw: Request):
        req = await _body(raw, RerankRequest)
        return await ready(raw, req.model, "score").rerank(req, raw)

    @app.post("/responses")
    async def create_response(raw: Request):
        req = await _body(raw, ResponsesRequest)
        serving = ready(raw, req.model, "generate")
        return await responses_api.create_response(serving, req, raw, store, client_of(raw))

    @app.get("/responses/{response_id}")
    async def get_response(response_id: str, raw: Request):
        stored = store.get(client_of(raw), response_id)
        if stored is None:
            raise APIError(
                404, f"no stored response {response_id!r}", type="not_found_error", code="response_not_found"
            )
        return json_bytes_response(stored.response)

    @app.delete("/responses/{response_id}")
    async def delete_response(response_id: str, raw: Request):
        if not store.delete(client_of(raw), response_id):
            raise APIError(
                404, f"no stored response {response_id!r}", type="not_found_error", code="response_not_found"
            )
        return {"id": response_id, "object": "response", "deleted": True}

    def lora():
        serving = next((s for s in router().servings if getattr(s, "lora", None) is not None), None)
        if serving is None:
            raise APIError(400, "LoRA adapters are not enabled on this server (set TIFFIN_LORA_ROOTS)")
        _check_healthy(serving)
        return serving.lora

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(raw: Request):
        req = await _body(raw, LoadLoRAAdapterRequest)
        return PlainTextResponse(await lora().load(req.lora_name, req.lora_path))

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(raw: Request):
        req = await _body(raw, UnloadLoRAAdapterRequest)
        return PlainTextResponse(await lora().unload(req.lora_name))

    @app.post("/messages")
    async def messages(raw: Request):
        req = await _body(raw, MessagesRequest)
        return await serve_messages(ready(raw, req.model, "generate"), req, raw)

    @app.post("/messages/count_tokens")
    async def messages_count_tokens(raw: Request):
        req = await _body(raw, CountTokensRequest)
        return await count_tokens(ready(raw, req.model, "generate"), req)

    batch_routes(app, batches)
    _tokenize_routes(app, app)
    _answer_errors(app)
    return app


def create_v2_app(v1: FastAPI) -> FastAPI:
    """/v2/rerank (Cohere's v2 path, which vLLM serves too) over the servings of the /v1 app `v1`: the same route
    as /v1/rerank."""
    app = FastAPI(title="tiffin rerank API", docs_url=None, redoc_url=None, openapi_url=None)

    @app.post("/rerank")
    async def rerank(raw: Request):
        req = await _body(raw, RerankRequest)
        return await _ready(v1, raw, req.model, "score").rerank(req, raw)

    _answer_errors(app)
    return app


def create_root_app(v1: FastAPI) -> FastAPI:
    """/tokenize and /detokenize at the root, where vLLM serves them, over the servings of the /v1 app `v1`; and
    /health, vLLM's path, with a JSON detail of each engine's health."""
    app = FastAPI(title="tiffin tokenizer API", docs_url=None, redoc_url=None, openapi_url=None)
    _tokenize_routes(app, v1)

    @app.get("/health")
    async def health():
        """Each model's engine and, under data parallelism, each of its replicas (`replica_health`): 200 while every
        model serves (one live replica is enough), else 503."""
        router = v1.state.router
        models = [] if router is None else [_health(serving) for serving in router.servings]
        ok = router is not None and all(m["healthy"] for m in models)
        status = "ok" if ok else "loading" if router is None else "unavailable"
        return JSONResponse({"status": status, "models": models}, status_code=200 if ok else 503)

    _answer_errors(app)
    return app


def _tokenize_routes(app: FastAPI, v1: FastAPI) -> None:
    @app.post("/tokenize")
    async def tokenize_route(raw: Request):
        req = await _body(raw, TokenizeRequest)
        return await tokenize(_ready(v1, raw, req.model, "tokenize"), req, v1.state.max_tokenize_ids)

    @app.post("/detokenize")
    async def detokenize_route(raw: Request):
        req = await _body(raw, DetokenizeRequest)
        return await detokenize(_ready(v1, raw, req.model, "tokenize"), req, v1.state.max_tokenize_ids)


def _is_messages_api(raw: Request) -> bool:
    return raw.url.path.rstrip("/").endswith(("/messages", "/messages/count_tokens"))


def _answer_errors(app: FastAPI) -> None:
    """Every failure as an `APIError`, answered in the error shape of the API its path belongs to."""

    @app.exception_handler(APIError)
    async def api_error(raw: Request, e: APIError) -> JSONResponse:
        body = error_body(e) if _is_messages_api(raw) else e.body()
        return JSONResponse(body, status_code=e.status, headers={"Retry-After": "1"} if e.status == 429 else None)

    @app.exception_handler(EngineAsleep)
    async def asleep(raw: Request, e: EngineAsleep) -> JSONResponse:
        return await api_error(raw, APIError(503, str(e), type="service_unavailable", code="engine_asleep"))

    @app.exception_handler(RequestValidationError)
    async def invalid(raw: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0]
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            return await api_error(raw, APIError(400, f"invalid JSON body: {err.get('msg')}"))
        where = ".".join(loc) or "body"
        return await api_error(raw, APIError(400, f"{where}: {err.get('msg')}", param=loc[0] if loc else None))

    @app.exception_handler(Exception)
    async def server_error(raw: Request, e: Exception) -> JSONResponse:
        return await api_error(raw, APIError(500, f"{type(e).__name__}: {e}", type="server_error"))

    @app.exception_handler(HTTPException)
    async def http_error(raw: Request, e: HTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return await api_error(raw, APIError(e.status_code, str(e.detail), type=kind))


async def _body(raw: Request, model: type[Body]) -> Body:
    """The request body as `model`, parsed and validated on a worker thread, refused as FastAPI refuses a body
    parameter: JSON only under a JSON content type, RequestValidationError for what does not decode or validate
    (APIError for what the model refuses itself), a 400 HTTPException for text that cannot be decoded."""
    body = await raw.body()
    message = email.message.Message()
    message["content-type"] = raw.headers.get("content-type", "")
    subtype = message.get_content_subtype()
    is_json = message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))

    def parse() -> Body:
        if not body:
            raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required"}])
        try:
            data = json.loads(body) if is_json else body
        except json.JSONDecodeError as e:
            error = {
                "type": "json_invalid",
                "loc": ("body", e.pos),
                "msg": "JSON decode error",
                "ctx": {"error": e.msg},
            }
            raise RequestValidationError([error], body=e.doc) from None
        except (ValueError, RecursionError):  # not UTF-8, -16 or -32; nested past what json.loads can recurse
            raise HTTPException(status_code=400, detail="There was an error parsing the body") from None
        try:
            return model.model_validate(data)
        except ValidationError as e:
            raise RequestValidationError(e.errors(include_url=False)) from None

    return await asyncio.to_thread(parse)


def attach_serving(app: FastAPI, servings: Serving | Sequence[Serving] | None) -> None:
    """Hand `servings` to an app made by `create_app`; its routes use them from the next request on."""
    if servings is None:
        app.state.router = None
    else:
        app.state.router = ModelRouter(servings if isinstance(servings, Sequence) else [servings])


def _router(app: FastAPI) -> ModelRouter:
    current: ModelRouter | None = app.state.router
    if current is None:
        raise APIError(503, "the model is still loading", type="service_unavailable")
    return current


def _ready(app: FastAPI, raw: Request, model: str | None, task: str) -> Serving:
    """The serving of `app` for `model` that can do `task` (what `raw`'s endpoint needs), with a working engine."""
    serving = _router(app).route(model, task, raw.url.path)
    _check_healthy(serving)
    return serving


def _health(serving: Serving) -> dict:
    engine = serving.engine
    replicas = getattr(engine.engine, "replica_health", None)
    detail = {"model": serving.model_name, "healthy": engine.healthy, "error": engine.dead}
    return detail | {"replicas": None if replicas is None else replicas()}


def _check_healthy(serving: Serving) -> None:
    if not serving.engine.healthy:
        raise APIError(503, serving.engine.dead or "the engine is shut down", type="service_unavailable")
