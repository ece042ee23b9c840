"""Pooling models in the engine: embeddings and cross-encoder scores against sentence-transformers and transformers
on tiny random checkpoints (fp32, 1e-5), the request's pooling settings, long prompts, tasks, and pooling requests
beside generations in one continuous batch."""

import shutil

import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from tiffin import LLM, PoolingParams, SamplingParams
from tiffin.engine.errors import ParamError
from tiffin.engine.turns import StepTurns
from tiffin.engine.worker import model_runner
from tiffin.tiny import make_tiny_model
from tiffin.tiny_bert import make_tiny_bert

TEXTS = [
    "hello world",
    "",
    "Déjà vu: naïve café, 東京 and 😀 emoji; مرحبا",
    "def main(): return [x ** 2 for x in range(10)]",
    " ".join(["the module imports the package and its submodules"] * 8),
    "a",
]


def cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)


def embeddings(llm: LLM, texts, **params) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in llm.embed(texts, PoolingParams(**params), use_tqdm=False)])


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    return make_tiny_bert(tmp_path_factory.mktemp("bert") / "m")


@pytest.fixture(scope="module")
def bert(bert_dir):
    return LLM(str(bert_dir), dtype="float32")


@pytest.fixture(scope="module")
def sentence_transformer(bert_dir):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(bert_dir), device="cpu")


def test_bert_embeddings_match_sentence_transformers(bert, sentence_transformer):
    got = embeddings(bert, TEXTS)
    want = sentence_transformer.encode(TEXTS, convert_to_tensor=True)
    assert (got - want).abs().max() < 1e-5
    assert cosines(got, want).min() > 0.99999
    alone = torch.cat([embeddings(bert, [t]) for t in TEXTS])  # the batch changes no result
    assert (alone - got).abs().max() < 1e-6
    assert bert.llm_engine.block_manager.num_used_blocks == 0


def test_cls_pooling_without_normalize_matches_transformers(tmp_path):
    path = make_tiny_bert(tmp_path / "cls", pooling="cls", normalize=False, seed=3)
    got = embeddings(LLM(str(path), dtype="float32"), TEXTS)
    model, tokenizer = AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        want = torch.cat([model(**tokenizer(t, return_tensors="pt")).last_hidden_state[:, 0] for t in TEXTS])
    assert (got - want).abs().max() < 1e-5


def test_dimensions_truncate_then_renormalize(bert):
    raw = embeddings(bert, TEXTS, normalize=False)
    assert (raw.norm(dim=1) - 1).abs().max() > 0.01  # the tiny model's mean is not a unit vector by itself
    cut = embeddings(bert, TEXTS, dimensions=16)
    assert cut.shape == (len(TEXTS), 16)
    assert (cut - torch.nn.functional.normalize(raw[:, :16], dim=1)).abs().max() < 1e-6
    with pytest.raises(ParamError) as refused:
        bert.embed(["x"], PoolingParams(dimensions=65), use_tqdm=False)
    assert refused.value.param == "dimensions" and "64" in str(refused.value)


def test_a_prompt_past_the_limit_is_refused_or_truncated_as_asked(bert, sentence_transformer):
    long = " ".join(["modules and packages"] * 60)  # past sentence_bert_config's max_seq_length of 128
    with pytest.raises(ParamError) as refused:
        bert.embed([long], use_tqdm=False)
    assert refused.value.param == "prompt" and "128" in str(refused.value) and "truncate" in str(refused.value)
    out = bert.embed([long], truncate_prompt_tokens=-1, use_tqdm=False)[0]
    assert len(out.prompt_token_ids) == 128
    want = sentence_transformer.encode([long], convert_to_tensor=True)  # it truncates to its max_seq_length
    assert (torch.tensor([out.outputs.embedding]) - want).abs().max() < 1e-5
    assert bert.llm_engine.block_manager.num_used_blocks == 0


def test_a_pooling_model_holds_one_step_of_kv_blocks(bert):
    engine = bert.llm_engine
    config = engine.config
    assert (
        engine.model_runner.num_blocks <= -(-config.max_num_batched_tokens // config.block_size) + config.max_num_seqs
    )
    assert not engine.block_manager.enable_prefix_caching  # an encoder's KV depends on the tokens after it


def test_tasks_are_refused_by_name(bert, tmp_path):
    with pytest.raises(ParamError) as refused:
        bert.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert refused.value.param == "model" and "embed" in str(refused.value)
    with pytest.raises(ParamError) as refused:
        bert.encode(["hello"], PoolingParams(task="classify"), use_tqdm=False)
    assert refused.value.param == "task"
    with pytest.raises(ValueError, match="BertModel serves 'embed', not 'generate'"):
        LLM(str(bert.llm_engine.config.model), task="generate")


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory):
    return make_tiny_bert(tmp_path_factory.mktemp("ce") / "m", cross_encoder=True, seed=1)


def test_cross_encoder_scores_match_sentence_transformers(cross_encoder_dir):
    from sentence_transformers import CrossEncoder

    query, documents = "how are modules imported", [TEXTS[0], TEXTS[2], TEXTS[4], "import the module", ""]
    llm = LLM(str(cross_encoder_dir), dtype="float32")
    assert llm.llm_engine.supported_tasks == ("classify",)
    got = torch.tensor([o.outputs.score for o in llm.score(query, documents, use_tqdm=False)])
    want = torch.from_numpy(CrossEncoder(str(cross_encoder_dir), device="cpu").predict([(query, d) for d in documents]))
    assert (got - want).abs().max() < 1e-5
    assert got.argsort().tolist() == want.argsort().tolist()
    pairwise = llm.score([query, TEXTS[0]], [documents[0], documents[1]], use_tqdm=False)
    assert abs(pairwise[0].outputs.score - got[0]) < 1e-6


def test_an_embedding_model_scores_by_cosine(bert):
    scores = [o.outputs.score for o in bert.score(TEXTS[0], TEXTS[2:5], use_tqdm=False)]
    vectors = embeddings(bert, TEXTS[:5])
    assert torch.allclose(torch.tensor(scores, dtype=torch.float64), cosines(vectors[0], vectors[2:5]), atol=1e-6)


def bare_decoder(tmp_path, arch: str):
    """A tiny decoder saved as transformers' headless model (LlamaModel, Qwen2Model, Qwen3Model), as embedding
    checkpoints such as Qwen3-Embedding and gte-Qwen2 ship."""
    causal = make_tiny_model(tmp_path / f"{arch}-causal", arch, seed=5)
    model = AutoModel.from_pretrained(causal)
    model.save_pretrained(tmp_path / arch)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(causal / name, tmp_path / arch / name)
    return tmp_path / arch, model.eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_decoder_embeddings_match_transformers(tmp_path, arch):
    path, model = bare_decoder(tmp_path, arch)
    llm = LLM(str(path), dtype="float32")
    assert llm.llm_engine.model_config.architecture.endswith("Model") and llm.llm_engine.task == "embed"
    got = embeddings(llm, [t for t in TEXTS if t])
    tokenizer = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():  # last-token pooling, normalized
        hidden = [model(**tokenizer(t, return_tensors="pt")).last_hidden_state[0, -1] for t in TEXTS if t]
    want = torch.nn.functional.normalize(torch.stack(hidden), dim=1)
    assert (got - want).abs().max() < 1e-5


def test_a_generation_model_embeds_beside_its_generations(tmp_path):
    """Embedding requests share steps with generations: each result equals the same request served alone."""
    path = make_tiny_model(tmp_path / "llama", "llama", seed=2)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["def f(x): return", "import os", "class A:"]
    llm = LLM(str(path), dtype="float32", prefill_first=False)  # decodes and prefills share steps
    assert llm.llm_engine.supported_tasks == ("generate", "embed")
    alone_text = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone_vectors = embeddings(llm, TEXTS[2:5])
    engine, mixed = llm.llm_engine, []
    execute = engine.model_runner.execute
    engine.model_runner.execute = lambda out: mixed.append(bool(out.pooling_seqs and out.sampling_seqs)) or execute(out)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"g{i}", prompt, params)
    engine.step()  # the generations decode when the embeddings arrive
    for i, text in enumerate(TEXTS[2:5]):
        engine.add_request(f"e{i}", text, PoolingParams())
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {o.request_id: o for o in engine.step() if o.finished}
    assert any(mixed)
    assert [finished[f"g{i}"].outputs[0].token_ids for i in range(3)] == alone_text
    mixed_vectors = torch.tensor([finished[f"e{i}"].outputs.embedding for i in range(3)])
    assert (mixed_vectors - alone_vectors).abs().max() < 1e-6
    assert engine.block_manager.num_used_blocks == 0


def test_xlm_roberta_positions_start_past_the_padding_id(tmp_path, bert_dir):
    """RoBERTa's position rows start at pad_token_id + 1 (here 0 + 1: the offset is read, not assumed)."""
    from transformers import XLMRobertaConfig, XLMRobertaModel

    config = XLMRobertaConfig(
        vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=130, type_vocab_size=1, pad_token_id=0, initializer_range=0.1,
    )  # fmt: skip
    torch.manual_seed(4)
    model = XLMRobertaModel(config).eval()
    model.save_pretrained(tmp_path / "xlmr")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bert_dir / name, tmp_path / "xlmr" / name)
    llm = LLM(str(tmp_path / "xlmr"), dtype="float32")
    assert llm.llm_engine.max_model_len == 129
    got = embeddings(llm, TEXTS)  # no sentence-transformers files: the architecture's cls pooling, normalized
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "xlmr")
    with torch.no_grad():
        cls = torch.cat([model(**tokenizer(t, return_tensors="pt")).last_hidden_state[:, 0] for t in TEXTS])
    assert (got - torch.nn.functional.normalize(cls, dim=1)).abs().max() < 1e-5


@pytest.fixture(scope="module")
def on_cpu(tmp_path_factory, bert):
    """What the CUDA test compares with, computed before the emulation starts (a CPU model's prepacked weights
    cannot run under it): BERT's embeddings, a tiny llama's greedy tokens and one embedding."""
    path = make_tiny_model(tmp_path_factory.mktemp("llama") / "m", "llama", seed=2)
    llm = LLM(str(path), dtype="float32")
    tokens = llm.generate(["import os"], CUDA_GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    return embeddings(bert, TEXTS), path, tokens, embeddings(llm, TEXTS[:1])


CUDA_GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_the_cuda_path_pools_as_the_cpu_does(bert_dir, on_cpu, cuda_emulation, monkeypatch):
    """Under the CUDA emulation (Triton kernels in the interpreter, warm-up included): a BERT embeds as on CPU
    (its non-causal prefill kernel), captures no decode graphs, and a decoder's embedding requests run eagerly
    beside graphed decodes. Steps of at most 128 tokens: TEXTS run in the same two steps (4 texts, then 2 of 125
    tokens), and the KV sizing profiles a step of 128 tokens, not 4 sequences of 128 (under the interpreter each
    token of a step costs)."""
    bert_vectors, llama_dir, tokens, vector = on_cpu
    cuda = LLM(str(bert_dir), device="cuda", dtype="float32", max_num_seqs=4, max_num_batched_tokens=128)
    assert cuda.llm_engine.model_runner.decode_graphs is None
    assert (embeddings(cuda, TEXTS) - bert_vectors).abs().max() < 1e-5
    monkeypatch.setattr(model_runner, "warm_up_triton", lambda runner: None)  # the llama's: tested elsewhere
    llm = LLM(str(llama_dir), device="cuda", dtype="float32", max_num_seqs=4, num_kv_blocks=64, max_model_len=96)
    engine = llm.llm_engine
    engine.add_request("g", "import os", CUDA_GREEDY)
    engine.step()
    replays = cuda_emulation.replays
    engine.add_request("e", TEXTS[0], PoolingParams())
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {o.request_id: o for o in engine.step() if o.finished}
    assert cuda_emulation.replays > replays  # the decodes after the embedding replayed their graph
    assert finished["g"].outputs[0].token_ids == tokens
    assert (torch.tensor([finished["e"].outputs.embedding]) - vector).abs().max() < 1e-5


def test_a_yielding_engine_saves_its_turns_up_for_a_prompt_larger_than_one(bert):
    """Beside a busy engine whose steps grant 2.5 tokens a turn, the embedder's held steps run nothing until its
    saved turns cover its next prompt whole, then run it; results as unheld."""
    want = embeddings(bert, TEXTS)
    engine, turns, chat = bert.llm_engine, StepTurns(0.5), object()
    turns.join(chat)
    turns.join(engine, yields=True)
    turns.stepped(engine, 0.01, 100, busy=True)  # 10,000 tokens/s
    for i, text in enumerate(TEXTS):
        engine.add_request(f"held{i}", text, PoolingParams())
    finished, ran = {}, []
    try:
        while engine.has_unfinished_requests():
            turns.stepped(chat, 0.0005, 1, busy=True)  # a chat step between the embedder's turns
            budget = turns.budget(engine, engine.scheduler.max_num_batched_tokens)
            engine.scheduler.step_budget = budget
            finished |= {o.request_id: o for o in engine.step() if o.finished}
            assert engine.last_step_tokens <= budget
            ran.append(engine.last_step_tokens)
            turns.stepped(engine, 0.01, engine.last_step_tokens, busy=True)
    finally:
        engine.scheduler.step_budget = None
    assert ran.count(0) > len(TEXTS) and sum(ran) == sum(len(o.prompt_token_ids) for o in finished.values())
    got = torch.tensor([finished[f"held{i}"].outputs.embedding for i in range(len(TEXTS))])
    assert (got - want).abs().max() < 1e-6
