"""tiffin: a vLLM-class LLM engine packaged as a BentoML backend."""

import importlib
import os

# torch's OpenMP runtime (libgomp) spins 300,000 iterations at every barrier before it sleeps: beside a busy
# process, a waiting thread burns the core the thread it waits for needs. 20,000 keeps the idle speed and the
# speed beside a neighbour (figures: benchmarks/README.md). libgomp reads it once, when torch loads: a user's
# own setting wins. What tiffin set is kept, so that benchmarks can start their peers without it.
ENV_SET_BY_TIFFIN = {name: value for name, value in {"GOMP_SPINCOUNT": "20000"}.items() if name not in os.environ}
os.environ.update(ENV_SET_BY_TIFFIN)

# Resolved on first access, so that `import tiffin.plugin.service` (which `bentoml build` does) and
# `import tiffin.tiny` do not pull in torch and transformers.
_EXPORTS = {
    "LLM": "tiffin.engine.llm",
    "LLMEngine": "tiffin.engine.llm_engine",
    "AsyncLLMEngine": "tiffin.engine.async_llm_engine",
    "EngineConfig": "tiffin.engine.config",
    "SamplingParams": "tiffin.engine.sampling_params",
    "PoolingParams": "tiffin.engine.pooling_params",
    "PoolingRequestOutput": "tiffin.engine.outputs",
    "StructuredOutputsParams": "tiffin.engine.structured.params",
    "RequestOutput": "tiffin.engine.outputs",
    "CompletionOutput": "tiffin.engine.outputs",
    "Logprob": "tiffin.engine.outputs",
    "LoRARequest": "tiffin.engine.lora.request",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tiffin' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
