"""/v1/embeddings, /v1/score and /v1/rerank in process: the request models on their own, then a tiny BERT engine and
a tiny llama engine behind one app, driven by the official `openai` client and raw HTTP. Every embedding and score
equals what the engine gives for the same input alone (base64 decodes to exactly the floats); every refusal is a
400 naming its field, and leaves nothing running; a model asked for what it cannot do names its task."""

import pytest

pytest.importorskip("fastapi")

from tiffin.plugin.openai.protocol import (  # noqa: E402
    MAX_POOLING_INPUTS,
    APIError,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
)


def refused_param(call) -> str | None:
    with pytest.raises(APIError) as e:
        call()
    assert e.value.status == 400, e.value.message
    return e.value.param


def test_embedding_inputs_take_openais_four_shapes():
    assert EmbeddingRequest(input="hi").inputs() == ["hi"]
    assert EmbeddingRequest(input=["a", ""]).inputs() == ["a", ""]
    assert EmbeddingRequest(input=[5, 6]).inputs() == [[5, 6]]
    assert EmbeddingRequest(input=[[5], [6, 7]]).inputs() == [[5], [6, 7]]
    assert refused_param(lambda: EmbeddingRequest(input=[]).inputs()) == "input"
    assert refused_param(lambda: EmbeddingRequest(input=["x"] * (MAX_POOLING_INPUTS + 1)).inputs()) == "input"
    assert len(EmbeddingRequest(input=["x"] * MAX_POOLING_INPUTS).inputs()) == MAX_POOLING_INPUTS
    params = EmbeddingRequest(input="x", dimensions=8, normalize=False, truncate_prompt_tokens=-1).params()
    assert (params.task, params.dimensions, params.normalize, params.truncate_prompt_tokens) == ("embed", 8, False, -1)
    assert refused_param(lambda: EmbeddingRequest(input="x", dimensions=0).params()) == "dimensions"
    assert refused_param(lambda: EmbeddingRequest(input="x", truncate_prompt_tokens=0).params()) == (
        "truncate_prompt_tokens"
    )


def test_score_pairs_one_text_with_many_or_lists_pairwise():
    assert ScoreRequest(text_1="q", text_2="d").groups() == [("q", ["d"])]
    assert ScoreRequest(text_1="q", text_2=["a", "b"]).groups() == [("q", ["a", "b"])]
    assert ScoreRequest(text_1=["q"], text_2=["a", "b"]).groups() == [("q", ["a", "b"])]
    assert ScoreRequest(text_1=["q", "r"], text_2=["a", "b"]).groups() == [("q", ["a"]), ("r", ["b"])]
    assert refused_param(lambda: ScoreRequest(text_1=["q", "r"], text_2=["a", "b", "c"]).groups()) == "text_2"
    assert refused_param(lambda: ScoreRequest(text_1=[], text_2=["a"]).groups()) == "text_1"
    assert refused_param(lambda: ScoreRequest(text_1="q", text_2=[]).groups()) == "text_2"


def test_rerank_documents_are_texts_or_objects_with_text():
    req = RerankRequest(query="q", documents=["a", {"text": "b"}], top_n=1)
    assert req.texts() == ["a", "b"] and req.return_documents is None
    assert refused_param(lambda: RerankRequest(query="q", documents=[]).texts()) == "documents"
    assert refused_param(lambda: RerankRequest(query="q", documents=["a"], top_n=-1).texts()) == "top_n"
