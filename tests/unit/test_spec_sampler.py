"""Verification of proposals in the sampler is lossless: the emitted token follows the target's distribution p
whatever proposed it. Many independent rows, each verifying one proposal against the same small-vocabulary
logits, are counted against p with a chi-square test."""

from dataclasses import dataclass

import pytest
import torch

from tiffin.engine.sampling_params import SamplingParams
from tiffin.engine.worker.sampler import Sampler

VOCAB = 6
ROWS = 30_000
CHI2_999 = 20.515  # the 0.999 quantile of chi-square with VOCAB - 1 = 5 degrees of freedom
TARGET = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.07, 0.03])
DRAFT = torch.tensor([0.05, 0.05, 0.1, 0.2, 0.3, 0.3])  # disagrees with the target most of the time


@dataclass
class Row:
    """A logits row verifying `proposed` (SpecRow's interface, without a sequence)."""

    params: SamplingParams
    proposed: int
    draft_probs: torch.Tensor | None
    seed: int | None
    grammar = None
    forced = -1
    prompt_token_ids = ()
    output_token_ids = ()
    num_output_tokens = 0

    def noise_seed(self) -> int | None:
        return self.seed


class TargetAsResidual(Sampler):
    """The classic mistake: a rejected draft token replaced by a draw from p rather than the residual."""

    def _verify_drafts(self, probs, inputs):
        p = probs.clone()
        accept = super()._verify_drafts(probs, inputs)
        probs.copy_(p)
        return accept


def chi2(tokens: list[int]) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double()
    expected = TARGET.double() * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


def verify(sampler: Sampler, draft: bool, seeded: bool) -> list[int]:
    g = torch.Generator().manual_seed(1)
    q = DRAFT if draft else torch.full((VOCAB,), 1 / VOCAB)
    proposals = torch.multinomial(q, ROWS, replacement=True, generator=g).tolist()
    params = SamplingParams(temperature=1.0)
    rows = [Row(params, t, DRAFT if draft else None, i if seeded and i % 2 else None) for i, t in enumerate(proposals)]
    logits = TARGET.log().expand(ROWS, VOCAB).contiguous()
    out = sampler(logits, rows)
    accepted = sum(out.accepted)
    assert 0 < accepted < ROWS, "every proposal accepted or none: the test would see nothing"
    return out.token_ids


@pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "half-seeded"])
@pytest.mark.parametrize("draft", [True, False], ids=["draft-distribution", "deterministic"])
def test_emitted_tokens_follow_the_target(draft, seeded):
    assert chi2(verify(Sampler(set(), seed=0), draft, seeded)) < CHI2_999


def test_the_test_fails_when_rejections_draw_from_the_target():
    assert chi2(verify(TargetAsResidual(set(), seed=0), draft=True, seeded=False)) > 10 * CHI2_999


def test_greedy_rows_accept_exactly_their_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    params = SamplingParams(temperature=0)
    rows = [Row(params, 1, None, None), Row(params, 2, None, None), Row(params, -1, None, None)]
    out = Sampler(set())(logits, rows)
    assert out.accepted == [True, False, False] and out.token_ids == [1, 1, 0]


def test_a_seeded_row_samples_alike_with_and_without_a_proposal():
    """Exact acceptance keeps a seeded row's draw: its token is the same whatever was proposed."""
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0)).expand(8, 50).contiguous()
    params = SamplingParams(temperature=1.0)
    alone = Sampler(set())(logits, [Row(params, -1, None, 7 + i) for i in range(8)]).token_ids
    proposed = Sampler(set())(logits, [Row(params, i, None, 7 + i) for i in range(8)]).token_ids
    assert alone == proposed and len(set(alone)) > 1
