"""tiffin: a vLLM-class LLM engine packaged as a BentoML backend."""

from tiffin.engine.config import EngineConfig
from tiffin.engine.llm import LLM
from tiffin.engine.llm_engine import LLMEngine
from tiffin.engine.outputs import CompletionOutput, Logprob, RequestOutput
from tiffin.engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
