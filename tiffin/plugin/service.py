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
from pathlib import Path

import bentoml
from bentoml.exceptions import InvalidArgument, ServiceUnavailable
from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from tiffin.engine.sampling_params import SamplingParams
from tiffin.plugin.metrics import engine_metrics
from tiffin.plugin.model_store import resolve_model
from tiffin.plugin.openai_api import OpenAIServing, create_app

logger = logging.getLogger("tiffin.service")


class Settings(BaseModel):
    """Service settings; each is read from `--arg name=value`, else the env var TIFFIN_<NAME>."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None  # local HF directory or BentoML model tag; None: the built-in tiny model
    served_model_name: str | None = None  # the OpenAI `model` name; default: the model's name
    dtype: str = "auto"
    device: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes; "8GiB", "512MiB" and "2GB" are accepted
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    kernel_backend: str = "auto"
    seed: int = 0
    timeout: float = 600.0  # seconds to the first byte of a response (BentoML traffic timeout)
    load_gate: str | None = None  # test hook: weight loading waits until this path exists
    lora_roots: str | None = None  # directories adapters may load from (os.pathsep-separated); set: LoRA on
    max_loras: int = 4  # adapters one step may mix (device slots)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept parsed in host memory; default max_loras
    tool_parser: str = "auto"  # tool-call convention: hermes, llama3_json, or auto (from the chat template)

    @model_validator(mode="before")
    @classmethod
    def _environment(cls, args: dict) -> dict:
        env = {
            name: os.environ[f"TIFFIN_{name.upper()}"]
            for name in cls.model_fields
            if os.environ.get(f"TIFFIN_{name.upper()}")
        }
        return {**env, **args}

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _bytes(cls, value):
        if not isinstance(value, str):
            return value
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*", value.lower())
        if m is None:
            raise ValueError(f"kv_cache_memory must be bytes such as 8GiB or 512MiB, got {value!r}")
        return int(float(m[1]) * (1024 if m[3] else 1000) ** " kmgt".index(m[2] or " "))

    def engine_kwargs(self) -> dict:
        return {
            **self.model_dump(
                exclude={"model", "served_model_name", "timeout", "load_gate", "lora_roots", "tool_parser"}
            ),
            "enable_lora": self.lora_roots is not None,
        }


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
            openai_app.state.serving = OpenAIServing(
                engine, served, on_finished=self.metrics.on_finished, lora=lora, tool_parser=settings.tool_parser
            )
            import xgrammar  # noqa: F401 (structured outputs import it, slowly: not on a request's event loop)

            self.engine = engine
            logger.info("tiffin: %s loaded from %s in %.1fs", name, path, time.monotonic() - started)
        except Exception as e:  # /livez turns 503 so that an orchestrator restarts the replica
            logger.exception("tiffin: loading the model failed")
            self.load_error = f"{type(e).__name__}: {e}"

    @bentoml.on_shutdown
    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()

    @bentoml.api
    async def generate(
        self,
        prompt: str,
        max_tokens: int = 128,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        stop: list[str] | None = None,
        seed: int | None = None,
        ignore_eos: bool = False,
    ) -> str:
        """The completion of `prompt`."""
        params = _params(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            stop=stop,
            seed=seed,
            ignore_eos=ignore_eos,
        )
        text = ""
        async for text in self._texts(prompt, params):  # noqa: B007 (keeps the last)
            pass
        return text

    @bentoml.api
    async def generate_stream(
        self,
        prompt: str,
        max_tokens: int = 128,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        stop: list[str] | None = None,
        seed: int | None = None,
        ignore_eos: bool = False,
    ) -> AsyncGenerator[str, None]:
        """The completion of `prompt`, as text chunks while it is generated."""
        params = _params(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            stop=stop,
            seed=seed,
            ignore_eos=ignore_eos,
        )
        sent = 0
        async for text in self._texts(prompt, params):
            if len(text) > sent:
                yield text[sent:]
                sent = len(text)

    async def _texts(self, prompt: str, params: SamplingParams) -> AsyncGenerator[str, None]:
        """Cumulative output text of one request; leaving early aborts it."""
        if self.engine is None:
            raise ServiceUnavailable("the model is still loading")
        try:
            stream = await self.engine.add_request(f"gen-{uuid.uuid4().hex}", prompt, params)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        try:
            async for out in stream:
                if out.finished:
                    self.metrics.on_finished(stream, out)
                yield out.outputs[0].text
        finally:
            stream.close()


def _params(**kwargs) -> SamplingParams:
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise InvalidArgument(str(e)) from None
