"""Scores of text pairs, as vLLM's `score` gives them: a cross-encoder's relevance of each pair (task "classify"),
or the cosine similarity of the two texts' embeddings (task "embed"). One text against many, or pairwise."""

import torch

from tiffin.engine.errors import ParamError
from tiffin.engine.outputs import PoolingOutput, PoolingRequestOutput

MAX_PAIRS = 4096  # pairs one call may score


def score_pairs(data_1: str | list[str], data_2: str | list[str]) -> list[tuple[str, str]]:
    """(text_1, text_2) pairs: one text against each of the others, or two lists of equal length pairwise."""
    texts_1 = [data_1] if isinstance(data_1, str) else list(data_1)
    texts_2 = [data_2] if isinstance(data_2, str) else list(data_2)
    for name, texts in (("text_1", texts_1), ("text_2", texts_2)):
        if not texts or len(texts) > MAX_PAIRS or not all(isinstance(t, str) for t in texts):
            raise ParamError(name, f"{name} must be a string or a list of 1 to {MAX_PAIRS} strings")
    if len(texts_1) == 1:
        texts_1 = texts_1 * len(texts_2)
    if len(texts_1) != len(texts_2):
        raise ParamError("text_2", f"text_1 has {len(texts_1)} texts and text_2 {len(texts_2)}: one, or as many")
    return list(zip(texts_1, texts_2))


def cosine_scores(
    request_ids: list[str], firsts: list[PoolingRequestOutput], seconds: list[PoolingRequestOutput]
) -> list[PoolingRequestOutput]:
    """Each pair's cosine similarity (an embedding model's score), as one output per pair."""
    a = torch.tensor([o.outputs.embedding for o in firsts])
    b = torch.tensor([o.outputs.embedding for o in seconds])
    scores = torch.nn.functional.cosine_similarity(a, b, dim=1).tolist()
    return [
        PoolingRequestOutput(rid, x.prompt_token_ids + y.prompt_token_ids, PoolingOutput([s]))
        for rid, x, y, s in zip(request_ids, firsts, seconds, scores)
    ]
