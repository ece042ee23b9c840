"""Prompt lookup (vLLM's `ngram` method): propose what followed the latest earlier occurrence of the sequence's
last n tokens, for the longest n from `max_n` down to `min_n` that occurs."""

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tiffin.engine.core.sequence import Sequence


class NgramProposer:
    def __init__(self, k: int, min_n: int, max_n: int):
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            seq.spec_token_ids = lookup(np.asarray(seq.token_ids), self.k, self.min_n, self.max_n)


def lookup(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of `tokens`' longest suffix of `min_n` to
    `max_n` tokens; [] when none occurs."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        # windows that end before the last token: the suffix itself is not an earlier occurrence
        hits = np.flatnonzero((sliding_window_view(tokens[:-1], n) == tokens[-n:]).all(1))
        if len(hits):
            start = hits[-1] + n
            return tokens[start : start + k].tolist()
    return []
