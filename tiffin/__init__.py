"""tiffin: a vLLM-class LLM engine packaged as a BentoML backend."""

import importlib

# Resolved on first access, so that `import tiffin.plugin.service` (which `bentoml build` does) and
# `import tiffin.tiny` do not pull in torch and transformers.
_EXPORTS = {
    "LLM": "tiffin.engine.llm",
    "LLMEngine": "tiffin.engine.llm_engine",
    "AsyncLLMEngine": "tiffin.engine.async_llm_engine",
    "EngineConfig": "tiffin.engine.config",
    "SamplingParams": "tiffin.engine.sampling_params",
    "StructuredOutputsParams": "tiffin.engine.structured_outputs",
    "RequestOutput": "tiffin.engine.outputs",
    "CompletionOutput": "tiffin.engine.outputs",
    "Logprob": "tiffin.engine.outputs",
    "LoRARequest": "tiffin.engine.lora",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tiffin' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
