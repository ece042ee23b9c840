"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`): each prompt token's logprob and rank under the model,
and the top k at its position, from the logits of the position before it.

A step computes logits for the sampling rows, then for the prompt rows of the sequences that ask
(`SchedulerOutput.prompt_rows`, appended to `logits_indices`): a prefill chunk contributes its own positions, so a
prompt run in chunks gives each position once, and no other request's rows are ever computed or kept. The logprobs
are the model's raw ones (before any sampling processor: vLLM's default), in fp32."""

import numpy as np
import torch

from tiffin.engine.core.scheduler import SchedulerOutput
from tiffin.engine.outputs import Logprob
from tiffin.engine.worker.sampler import logprob_entry, logprob_table


def prompt_logprobs(logits: torch.Tensor, scheduler_output: SchedulerOutput) -> list[list[dict[int, Logprob]]]:
    """One list per `scheduler_output.prompt_rows` entry (first, rows): the entries of prompt tokens first + 1 ...
    first + rows, from `logits`, the step's prompt rows in that order. One log_softmax and one topk over all of
    them, one read back; Python only builds the output dicts."""
    seqs, entries = scheduler_output.seqs, scheduler_output.prompt_rows
    targets = np.concatenate([seqs[i].token_ids[first + 1 : first + 1 + rows] for i, first, rows in entries])
    ks = [seqs[i].params.prompt_logprobs for i, _, _ in entries]
    k = min(max(ks), logits.shape[1])
    logprobs = torch.log_softmax(logits, -1, dtype=torch.float32)
    table = logprob_table(logprobs, torch.from_numpy(targets).to(logits.device), k)
    out, start = [], 0
    for (_, _, rows), n in zip(entries, ks):
        out.append([logprob_entry(row, k, n) for row in table[start : start + rows]])
        start += rows
    return out
