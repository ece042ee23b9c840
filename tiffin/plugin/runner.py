"""A legacy `bentoml.legacy.Runnable` over the offline `LLM`, for Bentos still built on Runners:

    runner = tiffin.plugin.runner.make_runner("path/to/model")
    svc = bentoml.runner_service(runner)            # or runner.init_local(); runner.generate.run("Hi")

New code should serve `tiffin.plugin.service:Tiffin`, which streams and batches requests continuously."""

import threading

import bentoml
from bentoml._internal.runner.runnable import RunnableMethod

from tiffin.plugin.model_store import resolve_model


class _Method(RunnableMethod):
    """A Runnable method that `bentoml.runner_service` can serve: BentoML 1.4's service wrappers call
    `instance.<api>.local`, which plain Runnable methods lack (runner_service fails at startup)."""

    def __get__(self, obj, owner=None):
        method = super().__get__(obj, owner)
        if obj is not None:
            method.local = method
        return method


def _method(**config):
    def wrap(func):
        plain = bentoml.legacy.Runnable.method(func, **config)
        return _Method(func=plain.func, config=plain.config)

    return wrap


class TiffinRunnable(bentoml.legacy.Runnable):
    SUPPORTED_RESOURCES = ("nvidia.com/gpu", "cpu")
    SUPPORTS_CPU_MULTI_THREADING = True

    def __init__(self, model: str | None = None, **engine_kwargs):
        """`model`: a local HF directory or BentoML model tag (None: the built-in tiny model);
        `engine_kwargs`: the `LLM` / EngineConfig keywords."""
        from tiffin.engine.llm import LLM

        self.llm = LLM(resolve_model(model)[0], **engine_kwargs)
        self._lock = threading.Lock()  # LLM is synchronous; concurrent callers take turns

    @_method(batchable=False)
    def generate(
        self,
        prompt: str,
        max_tokens: int = 128,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: list[str] | None = None,
        seed: int | None = None,
    ) -> str:
        """The completion of `prompt`."""
        return self._generate([prompt], max_tokens, temperature, top_p, top_k, stop, seed)[0]

    @_method(batchable=False)
    def generate_batch(
        self,
        prompts: list[str],
        max_tokens: int = 128,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: list[str] | None = None,
        seed: int | None = None,
    ) -> list[str]:
        """The completion of each prompt, generated as one continuous batch."""
        return self._generate(prompts, max_tokens, temperature, top_p, top_k, stop, seed)

    def _generate(self, prompts: list[str], max_tokens, temperature, top_p, top_k, stop, seed) -> list[str]:
        from tiffin.engine.sampling_params import SamplingParams

        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, stop=stop, seed=seed
        )
        with self._lock:
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [out.outputs[0].text for out in outputs]


def make_runner(model: str | None = None, name: str = "tiffin", **engine_kwargs) -> bentoml.legacy.Runner:
    return bentoml.legacy.Runner(TiffinRunnable, name=name, runnable_init_params={"model": model, **engine_kwargs})
