"""A long text to pool with `truncate_prompt_tokens` is cut before it is tokenized (issue #50: a 9 MB input took 18 s
to tokenize, then kept 256 tokens), only on the side truncation drops, and gives the same tokens as tokenizing it
all then truncating: a tiny llama's byte-level BPE and a tiny BERT's WordPiece, keeping the start or the end."""

import random

import pytest

from tiffin.engine.pooling_params import PoolingParams
from tiffin.engine.truncation import cut_for_truncation
from tiffin.tiny import make_tiny_model
from tiffin.tiny_bert import make_tiny_bert

WORDS = ["import", "modules", "café", "東京", "😀", "naïve", "x**2", "  ", "\n", "déjà", "don't", "a" * 40, ",", "."]


def texts() -> list[str]:
    rng = random.Random(0)
    words = " ".join(rng.choice(WORDS) for _ in range(3000))
    return [
        words,
        "".join(rng.choice(WORDS) for _ in range(3000)),  # no spaces between words
        "word " + " " * 20000 + "tail " * 50,  # whitespace, which tokens skip
        "ab" * 20000,  # one long word
        "東京大学" * 5000,
    ]


@pytest.fixture(scope="module", params=["llama", "bert"])
def tokenizer(request, tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp(request.param)
    path = make_tiny_model(root / "m") if request.param == "llama" else make_tiny_bert(root / "m")
    return AutoTokenizer.from_pretrained(str(path))


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_cut_text_tokenizes_as_the_whole_then_truncated(tokenizer, side):
    tokenizer.truncation_side = side
    longest = max(map(len, tokenizer.get_vocab()))
    cut_any = False

    def kept(text: str, keep: int) -> list[int]:  # as LLMEngine.tokenize truncates
        ids = tokenizer.encode(text, truncation=True, max_length=keep)
        return ids[:keep] if side == "right" else ids[-keep:]

    for text in texts():
        for keep in (1, 7, 64):
            piece = cut_for_truncation(tokenizer, text, keep, longest)
            assert kept(piece, keep) == kept(text, keep), (text[:40], keep, side)
            assert piece == (text[: len(piece)] if side == "right" else text[len(text) - len(piece) :])
            cut_any |= len(piece) < len(text)
    assert cut_any


def test_the_engine_tokenizes_only_what_truncation_keeps(tmp_path):
    from tiffin import LLM

    llm = LLM(str(make_tiny_bert(tmp_path / "m")), dtype="float32")
    engine = llm.llm_engine
    try:
        text = "modules and packages " * 200_000  # 4 MB
        seen = []
        encode = engine.tokenizer.encode

        def spy(t, *args, **kwargs):
            seen.append(len(t))
            return encode(t, *args, **kwargs)

        engine.tokenizer.encode = spy
        try:
            got = engine.tokenize(text, PoolingParams("embed", truncate_prompt_tokens=-1))
        finally:
            del engine.tokenizer.encode
        assert max(seen) < len(text) / 100, seen  # not the whole text
        want = encode(text, truncation=True, max_length=engine.max_model_len)
        assert got.token_ids == want[: engine.max_model_len] and got.text == text
    finally:
        llm.llm_engine.shutdown()
