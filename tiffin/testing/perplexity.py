"""Perplexity of an engine's model on a fixed held-out English text, by teacher forcing: how the int8 path of
quantized layers is held to the exact one."""

import math
import pydoc_data.topics

import torch

from tiffin.engine.core.scheduler import SchedulerOutput
from tiffin.engine.core.sequence import Sequence
from tiffin.engine.llm import LLM
from tiffin.engine.sampling_params import SamplingParams


def heldout_text() -> str:
    """The prose of Python's own documentation topics (`pydoc_data.topics`), in a fixed order."""
    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[name] for name in sorted(topics))


def perplexity(llm: LLM, token_ids: list[int], window: int = 512) -> float:
    """exp(mean negative log-likelihood) of each token after the first, in independent windows of `window`
    tokens of context (the engine needs `window / block_size` free KV blocks)."""
    runner, nll, count = llm.llm_engine.model_runner, 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        chunk = token_ids[start : start + window + 1]
        seq = Sequence("perplexity", 0, chunk[:-1], SamplingParams(), 1)
        seq.block_table = list(range(-(-len(seq.token_ids) // runner.block_size)))
        step = SchedulerOutput()
        step.add(seq, len(seq.token_ids))
        inputs = runner.prepare(step)
        with torch.inference_mode():
            hidden = runner.model(inputs.input_ids, inputs.positions, inputs.attn, inputs.lora)
            logits = runner.model.compute_logits(hidden[: len(seq.token_ids)]).float()
        nll += torch.nn.functional.cross_entropy(logits, torch.tensor(chunk[1:]), reduction="sum").item()
        count += len(chunk) - 1
    return math.exp(nll / count)
