"""tiffin as a Bento: `bentoml serve tiffin.plugin.service:Tiffin`.

Configuration: environment variables TIFFIN_<SETTING> or `bentoml serve ... --arg <setting>=<value>` (the
argument wins); see `Settings`. With no model set, the Bento serves the built-in tiny model, created in the
BentoML model store on first start. Weights load in a background thread: /livez answers at once, /readyz is
503 until the engine is up. The OpenAI-compatible API (tiffin.plugin.openai_api) is mounted at /v1; with
TIFFIN_LORA_ROOTS set it serves LoRA adapters too (tiffin.plugin.lora).

Torch and the engine are imported inside the loader thread, so `bentoml build` imports this module quickly.
"""

import logging
import os
import re
import threading
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import fields
from pathlib import Path
from typing import Any

import bentoml
from bentoml.exceptions import InvalidArgument, ServiceUnavailable
from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from tiffin.engine.config import EngineConfig
from tiffin.engine.sampling_params import SamplingParams
from tiffin.plugin.metrics import engine_metrics
from tiffin.plugin.model_store import resolve_model
from tiffin.plugin.openai_api import OpenAIServing, create_app

logger = logging.getLogger("tiffin.service")


# EngineConfig fields the service sets itself: it resolves the model (a store tag or a directory, which holds the
# tokenizer) and turns LoRA on when lora_roots is set. Every other field is a setting of the same name.
_SERVICE_SET = {"model", "tokenizer", "enable_lora"}
_ENGINE_SETTINGS = [f for f in fields(EngineConfig) if f.name not in _SERVICE_SET]


class _ServiceSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(
        None, description="local HF directory or BentoML model tag; None: the built-in tiny model"
    )
    served_model_name: str | None = Field(None, description="the OpenAI `model` name; default: the model's name")
    timeout: float = Field(600.0, description="seconds to the first byte of a response (BentoML traffic timeout)")
    load_gate: str | None = Field(None, description="test hook: weight loading waits until this path exists")
    lora_roots: str | None = Field(
        None, description="directories adapters may load from (os.pathsep-separated); set: LoRA on"
    )

    @model_validator(mode="before")
    @classmethod
    def _environment(cls, args: dict) -> dict:
        env = {
            name: os.environ[f"TIFFIN_{name.upper()}"]
            for name in cls.model_fields
            if os.environ.get(f"TIFFIN_{name.upper()}")
        }
        return {**env, **args}

    @field_validator("kv_cache_memory", mode="before", check_fields=False)
    @classmethod
    def _bytes(cls, value):
        """Besides a byte count, "8GiB", "512MiB" and "2GB"."""
        if not isinstance(value, str):
            return value
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*", value.lower())
        if m is None:
            raise ValueError(f"kv_cache_memory must be bytes such as 8GiB or 512MiB, got {value!r}")
        return int(float(m[1]) * (1024 if m[3] else 1000) ** " kmgt".index(m[2] or " "))

    def engine_kwargs(self) -> dict:
        return {f.name: getattr(self, f.name) for f in _ENGINE_SETTINGS} | {"enable_lora": self.lora_roots is not None}


Settings = create_model(
    "Settings",
    __base__=_ServiceSettings,
    __doc__="Service settings; each is read from `--arg name=value`, else the env var TIFFIN_<NAME>.",
    **{f.name: (f.type, Field(f.default, description=f.metadata["doc"])) for f in _ENGINE_SETTINGS},
)


class GenerateRequest(BaseModel):
    """The request of the typed APIs: a prompt and how to sample its completion."""

    prompt: str
    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop: list[str] | None = None
    seed: int | None = None
    ignore_eos: bool = False

    def sampling_params(self) -> SamplingParams:
        try:
            return SamplingParams(**self.model_dump(exclude={"prompt"}))
        except ValueError as e:
            raise InvalidArgument(str(e)) from None


settings = bentoml.use_arguments(Settings)
openai_app = create_app()


@bentoml.asgi_app(openai_app, path="/v1")
@bentoml.service(
    name="tiffin",
    labels={"openai_endpoint": "/v1"},
    workers=1,  # one engine per process owns the accelerator
    traffic={
        "timeout": settings.timeout,
        "concurrency": settings.max_num_seqs,  # what one replica batches; the autoscaling target
        "max_concurrency": 4 * settings.max_num_seqs,  # beyond this, 429 instead of an ever longer queue
    },
)
class Tiffin:
    if settings.model and "/" not in settings.model and not Path(settings.model).is_dir():
        weights = bentoml.models.BentoModel(settings.model)  # a model-store tag: the Bento carries it

    def __init__(self) -> None:
        self.engine = None
        self.load_error: str | None = None
        self.metrics = engine_metrics()
        threading.Thread(target=self._load, name="tiffin-loader", daemon=True).start()

    def __is_ready__(self) -> bool:
        return self.engine is not None

    def __is_alive__(self) -> bool:
        return self.load_error is None

    def _load(self) -> None:
        try:
            while settings.load_gate and not Path(settings.load_gate).exists():
                time.sleep(0.1)
            from tiffin.engine.async_llm_engine import AsyncLLMEngine

            path, name = resolve_model(settings.model)
            started = time.monotonic()
            engine = AsyncLLMEngine.from_engine_args(path, on_stats=self.metrics.on_stats, **settings.engine_kwargs())
            served = settings.served_model_name or name
            lora = None
            if settings.lora_roots is not None:
                from tiffin.plugin.lora import LoRAServing

                lora = LoRAServing(engine, settings.lora_roots, served)
            openai_app.state.serving = OpenAIServing(engine, served, on_finished=self.metrics.on_finished, lora=lora)
            self.engine = engine
            logger.info("tiffin: %s loaded from %s in %.1fs", name, path, time.monotonic() - started)
        except Exception as e:  # /livez turns 503 so that an orchestrator restarts the replica
            logger.exception("tiffin: loading the model failed")
            self.load_error = f"{type(e).__name__}: {e}"

    @bentoml.on_shutdown
    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()

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
        """Cumulative output text of one request; leaving early aborts it."""
        params = request.sampling_params()
        if self.engine is None:
            raise ServiceUnavailable("the model is still loading")
        try:
            stream = await self.engine.add_request(f"gen-{uuid.uuid4().hex}", request.prompt, params)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        try:
            async for out in stream:
                if out.finished:
                    self.metrics.on_finished(stream, out)
                yield out.outputs[0].text
        finally:
            stream.close()
