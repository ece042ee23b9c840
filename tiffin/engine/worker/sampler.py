"""Turns each sequence's last-position logits into its next token, with vLLM v1's sampling semantics.

Order: logprobs of the raw logits -> structured-output grammar and min_tokens masking -> penalties -> greedy argmax, or
temperature -> min_p -> top_k -> top_p -> exponential-race sampling."""

from collections.abc import Sequence as Seq
from concurrent.futures import Future
from dataclasses import dataclass
from itertools import chain
from typing import Protocol

import torch

from tiffin import kernels
from tiffin.engine.outputs import Logprob
from tiffin.engine.sampling_params import SamplingParams
from tiffin.engine.structured.backend import GrammarState, apply_bitmask

_GREEDY_EPS = 1e-5  # dividing by a smaller temperature overflows float32; such rows sample greedily


class SampledSeq(Protocol):
    params: SamplingParams
    generator: torch.Generator | None
    grammar: GrammarState | None

    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def output_token_ids(self) -> list[int]: ...
    @property
    def num_output_tokens(self) -> int: ...


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[dict[int, Logprob] | None]  # per row; None where params.logprobs is None


class Sampler:
    def __init__(self, eos_token_ids: set[int], seed: int = 0):
        self.eos_token_ids = frozenset(eos_token_ids)
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}  # one default stream per device

    def __call__(self, logits: torch.Tensor, seqs: Seq[SampledSeq], bitmask: Future | None = None) -> SamplerOutput:
        """`logits` in any float dtype (the model's); `bitmask`: `grammar.fill_bitmask(seqs, vocab)`, for sequences
        with structured outputs."""
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits must be [num_seqs={len(seqs)}, vocab], got {tuple(logits.shape)}")
        params = [s.params for s in seqs]
        wants_logprobs = any(p.logprobs is not None for p in params)
        penalized = [
            i for i, p in enumerate(params) if p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty
        ]
        rows = [i for i, p in enumerate(params) if p.temperature >= _GREEDY_EPS]
        if wants_logprobs or bitmask is not None or penalized or rows:
            logits = logits.float()  # else all greedy: the model dtype's argmax is fp32's, without the copy
        raw_logprobs = logits.log_softmax(-1) if wants_logprobs else None
        if bitmask is not None:
            apply_bitmask(logits, bitmask)
        logits = self._mask_min_tokens(logits, seqs)
        if penalized:  # count tensors only for the rows that need them
            logits = self._penalize(logits, [seqs[i] for i in penalized], penalized)
        sampled = kernels.argmax(logits)
        if rows:
            idx = torch.tensor(rows, device=logits.device)
            probs = sampling_probs(logits[idx], [params[i] for i in rows])
            sampled[idx] = self._race(probs, [seqs[i].generator for i in rows])
        token_ids = sampled.tolist()
        logprobs = [None] * len(seqs) if raw_logprobs is None else _gather_logprobs(raw_logprobs, sampled, params)
        return SamplerOutput(token_ids, logprobs)

    def _mask_min_tokens(self, logits: torch.Tensor, seqs: Seq[SampledSeq]) -> torch.Tensor:
        rows, cols = [], []
        vocab = logits.shape[1]
        for i, s in enumerate(seqs):
            p = s.params
            if s.num_output_tokens < p.min_tokens:
                banned = p.stop_token_set if p.ignore_eos else p.stop_token_set | self.eos_token_ids
                banned = [t for t in banned if t < vocab]
                rows += [i] * len(banned)
                cols += banned
        if not rows:
            return logits
        index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
        # in the logits' dtype: all-greedy batches keep the model's (bf16 on CUDA), and index_put does not cast
        return logits.index_put(index, torch.full((), -torch.inf, dtype=logits.dtype, device=logits.device))

    def _penalize(self, logits: torch.Tensor, seqs: list[SampledSeq], rows: list[int]) -> torch.Tensor:
        params = [s.params for s in seqs]
        idx = torch.tensor(rows, device=logits.device)
        penalized = apply_penalties(
            logits[idx],
            [s.prompt_token_ids for s in seqs],
            [s.output_token_ids for s in seqs],
            *(
                _column(params, name, logits)
                for name in ("repetition_penalty", "frequency_penalty", "presence_penalty")
            ),
        )
        return logits.index_put((idx,), penalized)

    def _race(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """argmax(probs / q), q ~ Exp(1) iid, picks token i with probability probs[i]. A seeded row draws
        its q from its own generator, so its tokens do not depend on the rest of the batch."""
        q = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if len(unseeded) == len(generators):
            q.exponential_(generator=self._default_generator(probs.device))
        elif unseeded:
            idx = torch.tensor(unseeded, device=probs.device)
            q[idx] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_(
                generator=self._default_generator(probs.device)
            )
        for i, g in enumerate(generators):
            if g is not None:  # drawn on the generator's own device: the same seed gives the same q anywhere
                q[i] = torch.empty(probs.shape[1], device=g.device).exponential_(generator=g)
        # exponential_ may return exactly 0, which would turn a zero-probability token into 0/0 = nan
        return kernels.argmax(probs.div_(q.clamp_(min=torch.finfo(q.dtype).tiny)))

    def _default_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    repetition_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    presence_penalties: torch.Tensor,
) -> torch.Tensor:
    """vLLM's penalties; each penalty is a [B] tensor. Repetition covers prompt and output tokens,
    frequency and presence only output tokens. Returns a new tensor."""
    vocab = logits.shape[1]
    output_counts = _token_counts(output_token_ids, vocab, logits.device)
    if (repetition_penalties != 1).any():
        seen = (output_counts > 0) | (_token_counts(prompt_token_ids, vocab, logits.device) > 0)
        rep = repetition_penalties[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return (
        logits
        - frequency_penalties[:, None] * output_counts
        - presence_penalties[:, None] * (output_counts > 0).to(logits.dtype)
    )


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each non-greedy row samples from (top_k 0 = off). Which filters run is decided from
    `params` on the host: reading the parameter tensors back would stall a GPU every step."""
    logits = logits / _column(params, "temperature", logits)[:, None]
    if any(p.min_p > 0 for p in params):
        probs = logits.softmax(-1)
        min_p = _column(params, "min_p", logits)
        logits = logits.masked_fill(probs < probs.amax(-1, keepdim=True) * min_p[:, None], -torch.inf)
    top_k = _column(params, "top_k", logits, torch.long)
    if any(p.top_p < 1 for p in params):
        logits = _top_k_top_p(logits, top_k, _column(params, "top_p", logits))
    elif (max_k := max(p.top_k for p in params)) > 0:
        logits = _top_k(logits, top_k, max_k)
    return logits.softmax(-1)


def _top_k(logits: torch.Tensor, top_k: torch.Tensor, max_k: int) -> torch.Tensor:
    """Top-k alone needs only the largest k values, far cheaper than the full sort top-p needs."""
    k = top_k.clamp(max=logits.shape[1])
    kth = logits.topk(min(max_k, logits.shape[1]), -1).values.gather(1, (k - 1).clamp(min=0)[:, None])
    kth = kth.masked_fill((k == 0)[:, None], -torch.inf)
    return logits.masked_fill(logits < kth, -torch.inf)  # ties with the k-th largest stay in


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[1]
    ascending, order = logits.sort(-1)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    kth = ascending.gather(1, (vocab - k)[:, None])
    ascending = ascending.masked_fill(ascending < kth, -torch.inf)  # ties with the k-th largest stay in
    # Drop a token when the tokens more likely than it already reach top_p, i.e. when the cumulative
    # probability from the bottom up to and including it is <= 1 - top_p. The top token always stays.
    cumulative = ascending.softmax(-1).cumsum(-1)
    drop = cumulative <= 1 - top_p[:, None]
    drop[:, -1] = False
    ascending = ascending.masked_fill(drop, -torch.inf)
    return torch.empty_like(logits).scatter_(1, order, ascending)


def _gather_logprobs(
    raw_logprobs: torch.Tensor,
    sampled: torch.Tensor,
    params: list[SamplingParams],
) -> list[dict[int, Logprob] | None]:
    """Top-`logprobs` entries plus the sampled token per row; rank = 1 + number of strictly more likely
    tokens (tied tokens share a rank)."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    lp = raw_logprobs[torch.tensor(rows, device=raw_logprobs.device)]
    tokens = sampled[torch.tensor(rows, device=sampled.device)]
    token_lp = lp.gather(1, tokens[:, None])
    token_rank = (lp > token_lp).sum(-1) + 1
    k = min(max(params[i].logprobs for i in rows), lp.shape[1])
    top_lp, top_ids = lp.topk(k, -1)
    # Anything strictly more likely than one of the top k is itself among the top k.
    top_rank = (top_lp[:, None, :] > top_lp[:, :, None]).sum(-1) + 1
    out: list[dict[int, Logprob] | None] = [None] * len(params)
    for i, tok, tlp, trank, ids, lps, ranks in zip(
        rows,
        tokens.tolist(),
        token_lp[:, 0].tolist(),
        token_rank.tolist(),
        top_ids.tolist(),
        top_lp.tolist(),
        top_rank.tolist(),
    ):
        n = params[i].logprobs
        entry = {tok: Logprob(tlp, trank)}
        entry.update((t, Logprob(v, rk)) for t, v, rk in zip(ids[:n], lps[:n], ranks[:n]))
        out[i] = entry
    return out


def _token_counts(token_ids: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[B, V] float counts of each token id per row, built in one bincount."""
    lengths = torch.tensor([len(t) for t in token_ids], device=device)
    flat = torch.tensor(list(chain.from_iterable(token_ids)), dtype=torch.long, device=device)
    rows = torch.repeat_interleave(torch.arange(len(token_ids), device=device), lengths)
    return torch.bincount(rows * vocab + flat, minlength=len(token_ids) * vocab).view(-1, vocab).float()


def _column(params: list[SamplingParams], name: str, like: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor([getattr(p, name) for p in params], dtype=dtype, device=like.device)
