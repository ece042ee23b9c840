"""Turns each sequence's last-position logits into its next token, with vLLM v1's sampling semantics.

Order: logprobs of the raw logits -> structured-output grammar and min_tokens masking -> penalties -> greedy argmax, or
temperature -> min_p -> top_k -> top_p -> exponential-race sampling.

A row's forced token (a reasoning model's end marker once its thinking budget is spent) replaces whatever it sampled,
after all of the above (it wins over min_tokens and penalties), so its logprobs are the forced token's.

Speculative decoding: a row that verifies a proposal accepts it exactly when it would have picked it. A token
proposed by a draft model, drawn from the draft's distribution q, is accepted with probability min(1, p/q) and
replaced, when rejected, by a draw from the residual max(p - q, 0): the emitted token follows p either way
(Leviathan et al., 2023). A deterministic proposal (n-gram, suffix) is the case of q one-hot: accepted when the
row's own draw from p equals it. So every emitted token follows the target's distribution, and with a seed
(draws keyed by the token's position) a deterministic proposal never changes what a row samples."""

from collections.abc import Sequence as Seq
from concurrent.futures import Future
from dataclasses import dataclass, field
from itertools import chain
from typing import Protocol

import numpy as np
import torch

from tiffin import kernels
from tiffin.engine.outputs import Logprob
from tiffin.engine.sampling_params import SamplingParams
from tiffin.engine.structured.backend import GrammarState, apply_bitmask
from tiffin.engine.worker.batch import Upload

_GREEDY_EPS = 1e-5  # dividing by a smaller temperature overflows float32; such rows sample greedily


class SampledSeq(Protocol):
    """A logits row's sequence (core.sequence's Sequence or SpecRow)."""

    params: SamplingParams
    grammar: GrammarState | None
    proposed: int  # the proposal the row verifies; -1: none
    forced: int  # the token the row emits whatever it samples; -1: none (a row with one verifies no proposal)
    draft_probs: torch.Tensor | None  # the distribution `proposed` was drawn from; None: deterministic

    def noise_seed(self) -> int | None: ...

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
    accepted: list[bool] = field(default_factory=list)  # per row: whether it accepts its proposal
    pooled: list[list[float]] = field(default_factory=list)  # the runner's: one result per pooling sequence
    # the runner's: one list per `SchedulerOutput.prompt_rows` entry (`worker.prompt_logprobs`)
    prompt_logprobs: list[list[dict[int, Logprob]]] = field(default_factory=list)


class SamplingInputs:
    """What a step's sampling needs from the host (row indices, parameter columns, banned and seen tokens), decided
    there from the sequences' params and added to the step's `Upload`, so that it travels with the batch."""

    def __init__(self, seqs: Seq[SampledSeq], upload: Upload, vocab: int, eos_token_ids: frozenset[int]):
        self.upload, self.vocab, self._parts, self.seeds = upload, vocab, {}, []
        params = self.params = [s.params for s in seqs]
        self.wants_logprobs = any(p.logprobs is not None for p in params)
        self.penalized = [
            i for i, p in enumerate(params) if p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty
        ]
        self.rows = [i for i, p in enumerate(params) if p.temperature >= _GREEDY_EPS]  # sampled, not greedy
        ints = lambda values: np.array(values, dtype=np.int64)
        floats = lambda params, name: np.array([getattr(p, name) for p in params], dtype=np.float32)
        if self.rows:
            sampled = [params[i] for i in self.rows]
            self._add("rows", ints(self.rows))
            for name in ("temperature", "min_p", "top_p"):
                self._add(name, floats(sampled, name))
            self._add("top_k", ints([p.top_k for p in sampled]))
            self.seeds = [seqs[i].noise_seed() for i in self.rows]  # of the sampled rows
            if any(seed is not None for seed in self.seeds):
                self._add("unseeded", ints([i for i, seed in enumerate(self.seeds) if seed is None]))
        banned_rows, banned_cols = [], []
        for i, s in enumerate(seqs):
            p = s.params
            if s.num_output_tokens < p.min_tokens:
                banned = p.stop_token_set if p.ignore_eos else p.stop_token_set | eos_token_ids
                banned = [t for t in banned if t < vocab]
                banned_rows += [i] * len(banned)
                banned_cols += banned
        if banned_rows:
            self._add("banned_rows", ints(banned_rows))
            self._add("banned_cols", ints(banned_cols))
        if self.penalized:
            pen = [seqs[i] for i in self.penalized]
            self._add("penalized", ints(self.penalized))
            for name in ("repetition_penalty", "frequency_penalty", "presence_penalty"):
                self._add(name, floats([s.params for s in pen], name))
            self._add("output_tokens", _flat_indices([s.output_token_ids for s in pen], vocab))
            self.repetition = any(s.params.repetition_penalty != 1 for s in pen)
            if self.repetition:
                self._add("seen_tokens", _flat_indices([s.prompt_token_ids + s.output_token_ids for s in pen], vocab))
        forced = [s.forced for s in seqs]
        if any(t >= 0 for t in forced):
            self._add("forced", ints(forced))
        proposed = [s.proposed for s in seqs]
        self.speculating = any(t >= 0 for t in proposed)
        # sampled rows (indices into `rows`) verifying a draft model's proposal, and its distribution for each
        self.draft_rows, self.draft_probs = [], []
        if self.speculating:
            self._add("proposed", ints(proposed))
            self.draft_rows = [j for j, i in enumerate(self.rows) if seqs[i].draft_probs is not None]
            self.draft_probs = [seqs[self.rows[j]].draft_probs for j in self.draft_rows]
        if self.wants_logprobs:
            self._add("logprob_rows", ints([i for i, p in enumerate(params) if p.logprobs is not None]))

    def _add(self, name: str, a: np.ndarray) -> None:
        self._parts[name] = self.upload.add(a)

    def __contains__(self, name: str) -> bool:
        return name in self._parts

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.upload.get(self._parts[name])


class Sampler:
    def __init__(self, eos_token_ids: set[int], seed: int = 0):
        self.eos_token_ids = frozenset(eos_token_ids)
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}  # one default stream per device
        self._reseeded: dict[torch.device, torch.Generator] = {}  # seeded afresh for each seeded row's draw

    def stage(self, seqs: Seq[SampledSeq], upload: Upload, vocab: int) -> SamplingInputs:
        """Add what sampling `seqs` will need from the host to the step's `upload` (before it is sent)."""
        return SamplingInputs(seqs, upload, vocab, self.eos_token_ids)

    def __call__(
        self,
        logits: torch.Tensor,
        seqs: Seq[SampledSeq],
        bitmask: Future | None = None,
        inputs: SamplingInputs | None = None,
    ) -> SamplerOutput:
        """`logits` in any float dtype (the model's); `bitmask`: `grammar.fill_bitmask(seqs, vocab)`, for sequences
        with structured outputs; `inputs`: `stage(seqs, ...)`, sent with the step's batch (staged and sent here
        when None). Device -> host: the sampled tokens, and one read of the logprobs when asked."""
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits must be [num_seqs={len(seqs)}, vocab], got {tuple(logits.shape)}")
        if inputs is None or inputs.vocab != logits.shape[1]:
            inputs = self.stage(seqs, Upload(logits.device), logits.shape[1])
        inputs.upload.send()
        params, rows = inputs.params, inputs.rows
        if inputs.wants_logprobs or bitmask is not None or inputs.penalized or rows:
            logits = logits.float()  # else all greedy: the model dtype's argmax is fp32's, without the copy
        raw_logprobs = logits.log_softmax(-1) if inputs.wants_logprobs else None
        if bitmask is not None:
            apply_bitmask(logits, bitmask)
        if "banned_rows" in inputs:
            # -inf in the logits' dtype: all-greedy batches keep the model's (bf16 on CUDA), and index_put does not
            # cast
            index = inputs["banned_rows"], inputs["banned_cols"]
            logits = logits.index_put(index, torch.full((), -torch.inf, dtype=logits.dtype, device=logits.device))
        if inputs.penalized:  # count tensors only for the rows that need them
            idx = inputs["penalized"]
            penalized = _penalties(
                logits[idx],
                inputs["output_tokens"],
                inputs["seen_tokens"] if inputs.repetition else None,
                inputs["repetition_penalty"],
                inputs["frequency_penalty"],
                inputs["presence_penalty"],
            )
            logits = logits.index_put((idx,), penalized)
        sampled, draft_accepted = kernels.argmax(logits), None
        if rows:
            idx = inputs["rows"]
            columns = {name: inputs[name] for name in ("temperature", "min_p", "top_k", "top_p")}
            probs = sampling_probs(logits[idx], [params[i] for i in rows], columns)
            draft_accepted = self._verify_drafts(probs, inputs) if inputs.draft_rows else None
            unseeded = inputs["unseeded"] if "unseeded" in inputs else None
            sampled[idx] = self._race(probs, inputs.seeds, unseeded)
        if "forced" in inputs:
            forced = inputs["forced"]
            sampled = torch.where(forced >= 0, forced, sampled)
        accepted = None
        if inputs.speculating:
            proposed = inputs["proposed"]
            accepted = sampled == proposed
            if draft_accepted is not None:
                accepted[idx[inputs.draft_rows]] = draft_accepted
            sampled = torch.where(accepted, proposed, sampled)
        if accepted is None:
            token_ids, accepted = sampled.tolist(), [False] * len(seqs)
        else:  # one read back
            token_ids, accepted = torch.stack([sampled, accepted.long()]).tolist()
            accepted = [bool(a) for a in accepted]
        logprobs = (
            [None] * len(seqs)
            if raw_logprobs is None
            else _gather_logprobs(raw_logprobs, sampled, params, inputs["logprob_rows"])
        )
        return SamplerOutput(token_ids, logprobs, accepted=accepted)

    def _verify_drafts(self, probs: torch.Tensor, inputs: SamplingInputs) -> torch.Tensor:
        """Accept each draft row's proposal with probability min(1, p/q); turn its row of `probs` (in place) into
        the residual max(p - q, 0) that a rejection draws from (p itself where nothing is left: p == q, always
        accepted). Returns whether each draft row accepts."""
        rows = torch.tensor(inputs.draft_rows, device=probs.device)
        p, q = probs[rows], torch.stack(inputs.draft_probs).to(probs.dtype)
        token = inputs["proposed"][inputs["rows"][rows]][:, None]
        u = torch.stack([self._uniform(inputs.seeds[j], probs.device) for j in inputs.draft_rows])
        accept = u * q.gather(1, token)[:, 0] < p.gather(1, token)[:, 0]
        residual = (p - q).clamp_(min=0)
        probs[rows] = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
        return accept

    def _uniform(self, seed: int | None, device: torch.device) -> torch.Tensor:
        generator = self._default_generator(device) if seed is None else self._seeded(device, seed ^ 1)
        return torch.rand((), device=device, generator=generator)

    def race(self, probs: torch.Tensor, seeds: list[int | None]) -> torch.Tensor:
        """A token per row of `probs`, drawn as `__call__` draws its sampled rows (a seeded row with the very noise
        a row of the same seed gets there)."""
        unseeded = [i for i, seed in enumerate(seeds) if seed is None]
        seeded = len(unseeded) < len(seeds)
        return self._race(probs, seeds, torch.tensor(unseeded, device=probs.device) if seeded else None)

    def _race(self, probs: torch.Tensor, seeds: list[int | None], unseeded: torch.Tensor | None) -> torch.Tensor:
        """argmax(probs / q), q ~ Exp(1) iid, picks token i with probability probs[i] (normalized or not). A
        seeded row draws its q from its own seed, so its tokens do not depend on the rest of the batch
        (`unseeded`: the other rows, when there are seeded ones)."""
        q = torch.empty_like(probs)
        if unseeded is None:
            q.exponential_(generator=self._default_generator(probs.device))
        elif len(unseeded):
            q[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_(
                generator=self._default_generator(probs.device)
            )
        for i, seed in enumerate(seeds):
            if seed is not None:
                q[i].exponential_(generator=self._seeded(q.device, seed))
        # exponential_ may return exactly 0, which would turn a zero-probability token into 0/0 = nan
        return kernels.argmax(probs.div_(q.clamp_(min=torch.finfo(q.dtype).tiny)))

    def _seeded(self, device: torch.device, seed: int) -> torch.Generator:
        """The device's generator for seeded draws, seeded with `seed`. A seed gives the same tokens on every
        device of a kind, not across kinds (the generators' streams differ)."""
        if device not in self._reseeded:
            self._reseeded[device] = torch.Generator(device=device)
        return self._reseeded[device].manual_seed(seed)

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
    vocab, device = logits.shape[1], logits.device
    output = torch.from_numpy(_flat_indices(output_token_ids, vocab)).to(device)
    seen = torch.from_numpy(_flat_indices([p + o for p, o in zip(prompt_token_ids, output_token_ids)], vocab))
    return _penalties(logits, output, seen.to(device), repetition_penalties, frequency_penalties, presence_penalties)


def _penalties(
    logits: torch.Tensor,
    output_tokens: torch.Tensor,
    seen_tokens: torch.Tensor | None,
    repetition_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    presence_penalties: torch.Tensor,
) -> torch.Tensor:
    """`apply_penalties` on `_flat_indices` of the output tokens and of the tokens seen (prompt and output; None:
    no repetition penalty in the batch). Counts are accumulated in place (a bincount would read its maximum back
    to size its output)."""
    rows, vocab = logits.shape
    output_counts = torch.zeros(rows * vocab, dtype=logits.dtype, device=logits.device)
    output_counts.index_add_(0, output_tokens, torch.ones(len(output_tokens), dtype=logits.dtype, device=logits.device))
    output_counts = output_counts.view(rows, vocab)
    if seen_tokens is not None:
        seen = torch.zeros(rows * vocab, dtype=torch.bool, device=logits.device)
        seen = seen.index_fill_(0, seen_tokens, True).view(rows, vocab)
        rep = repetition_penalties[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return (
        logits
        - frequency_penalties[:, None] * output_counts
        - presence_penalties[:, None] * (output_counts > 0).to(logits.dtype)
    )


def sampling_probs(
    logits: torch.Tensor, params: list[SamplingParams], columns: dict[str, torch.Tensor] | None = None
) -> torch.Tensor:
    """The distribution each non-greedy row samples from (top_k 0 = off). Which filters run is decided from
    `params` on the host: reading the parameter tensors back would stall a GPU every step. `columns`: the
    parameters as device tensors (temperature, min_p, top_k, top_p), already uploaded (made here when None)."""
    column = lambda name, dtype=torch.float32: (
        columns[name] if columns is not None else _column(params, name, logits, dtype)
    )
    logits = logits / column("temperature")[:, None]
    if any(p.min_p > 0 for p in params):
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < probs.amax(-1, keepdim=True) * column("min_p")[:, None], -torch.inf)
    top_k = column("top_k", torch.long)
    if any(p.top_p < 1 for p in params):
        logits = _top_k_top_p(logits, top_k, column("top_p"))
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
    rows: torch.Tensor,
) -> list[dict[int, Logprob] | None]:
    """Top-`logprobs` entries plus the sampled token per row of `rows` (the rows that asked)."""
    lp = raw_logprobs[rows]
    asked = [i for i, p in enumerate(params) if p.logprobs is not None]
    k = min(max(params[i].logprobs for i in asked), lp.shape[1])
    out: list[dict[int, Logprob] | None] = [None] * len(params)
    for i, row in zip(asked, logprob_table(lp, sampled[rows], k)):
        out[i] = logprob_entry(row, k, params[i].logprobs)
    return out


def logprob_table(logprobs: torch.Tensor, tokens: torch.Tensor, k: int) -> list[list[float]]:
    """Per row of `logprobs`: its token (of `tokens`), that token's logprob and rank, then the top `k` ids, logprobs
    and ranks; rank = 1 + number of strictly more likely tokens (tied tokens share a rank). One read back: every
    number in one float64 table (token ids and ranks are exact there)."""
    token_lp = logprobs.gather(1, tokens[:, None])
    token_rank = (logprobs > token_lp).sum(-1) + 1
    top_lp, top_ids = logprobs.topk(k, -1)
    # Anything strictly more likely than one of the top k is itself among the top k.
    top_rank = (top_lp[:, None, :] > top_lp[:, :, None]).sum(-1) + 1
    columns = (tokens[:, None], token_lp, token_rank[:, None], top_ids, top_lp, top_rank)
    return torch.cat([c.double() for c in columns], dim=1).tolist()


def logprob_entry(row: list[float], k: int, n: int) -> dict[int, Logprob]:
    """vLLM's entry for one position from a `logprob_table` row (of top `k`): its token, and the top `n` <= `k`."""
    ids, lps, ranks = row[3 : 3 + k], row[3 + k : 3 + 2 * k], row[3 + 2 * k :]
    entry = {int(row[0]): Logprob(row[1], int(row[2]))}
    entry.update((int(t), Logprob(v, int(rk))) for t, v, rk in zip(ids[:n], lps[:n], ranks[:n]))
    return entry


def _flat_indices(token_ids: list[list[int]], vocab: int) -> np.ndarray:
    """Row r's token t at r * vocab + t: the rows' tokens as indices into a flattened [rows, vocab] tensor."""
    lengths = np.array([len(t) for t in token_ids], dtype=np.int64)
    flat = np.fromiter(chain.from_iterable(token_ids), dtype=np.int64, count=int(lengths.sum()))
    return np.repeat(np.arange(len(token_ids), dtype=np.int64) * vocab, lengths) + flat


def _column(params: list[SamplingParams], name: str, like: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor([getattr(p, name) for p in params], dtype=dtype, device=like.device)
