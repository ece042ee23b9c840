"""Engine steps built by hand, for tests that compare one step's paths (the fused CPU decode step, the model's)."""

import torch

from tiffin import LLM, SamplingParams
from tiffin.engine.core.scheduler import SchedulerOutput
from tiffin.engine.core.sequence import Sequence


def decode_inputs(llm: LLM, prompts: list[list[int]]):
    """The runner's inputs for one decode step of `prompts`, their KV written by a prefill of all but the last."""
    runner, step = llm.llm_engine.model_runner, SchedulerOutput()
    seqs = [Sequence(f"s{i}", 0, p, SamplingParams(), 1) for i, p in enumerate(prompts)]
    blocks = 0
    for seq in seqs:
        needed = -(-len(seq.token_ids) // runner.block_size)
        seq.block_table = list(range(blocks, blocks + needed))
        blocks += needed
        step.add(seq, len(seq.token_ids) - 1)
    with torch.inference_mode():
        prefill = runner.prepare(step)
        runner.model(prefill.input_ids, prefill.positions, prefill.attn)
    decode = SchedulerOutput()
    for seq in seqs:
        seq.num_computed_tokens = len(seq.token_ids) - 1
        decode.add(seq, 1)
    return runner.prepare(decode)
