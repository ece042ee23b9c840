"""One workload for the executors' tests (Ray, headless multi-node): its greedy and seeded outputs must equal the
single-process engine's."""

import torch

from tiffin import LLM, SamplingParams

NEW_TOKENS = 12
PARAMS = [SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)] * 3
PARAMS += [SamplingParams(temperature=1.0, top_p=0.9, seed=s, max_tokens=NEW_TOKENS, ignore_eos=True) for s in (1, 2)]


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in (1, 9, 30, 5, 17)]


def run(llm: LLM, vocab: int) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts(vocab)], PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]
