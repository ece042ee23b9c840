"""The built-in tiny checkpoints: transformers loads them as written, tokenizers are exact, weights are useful."""

import json

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tiffin.tiny import BOS_ID, IM_END_ID, IM_START_ID, PAD_ID, SPECIAL_TOKENS, main, make_tiny_model, train_tokenizer

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
TEXTS = ["héllo 日本語 🙂", "def f(x):\n\treturn x  # ok\r\n", "", " \x00\x7f\u00a0 ÿ €"]


def _load(path):
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    return model.eval(), info


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_exactly_the_written_weights(tiny_model, arch):
    path = tiny_model(arch)
    config = json.loads((path / "config.json").read_text())
    model, info = _load(path)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert type(model).__name__ == config["architectures"][0] and model.dtype == torch.float32
    written = load_file(path / "model.safetensors")
    loaded = model.state_dict()
    for name, tensor in written.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0)
        if name.endswith(("norm.weight", ".bias")):  # HF would init these to constants; an engine bug must show
            assert tensor.std() > 0.05 and (tensor != 0).all(), name
    assert config["tie_word_embeddings"] == ("lm_head.weight" not in written)
    if config["tie_word_embeddings"]:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[BOS_ID, 100, 200, 300, 400]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 5, config["vocab_size"]) and logits.isfinite().all()


def test_arch_variants_are_what_they_claim(tiny_model):
    cfg = {arch: AutoConfig.from_pretrained(tiny_model(arch)) for arch in ARCHS}
    assert (cfg["llama"].num_attention_heads, cfg["llama"].num_key_value_heads) == (4, 2)
    assert cfg["mistral"].num_key_value_heads == 1 and cfg["mistral"].sliding_window is None
    assert cfg["qwen2"].num_key_value_heads == cfg["qwen2"].num_attention_heads and cfg["qwen2"].tie_word_embeddings
    assert cfg["qwen3"].head_dim == 32 != cfg["qwen3"].hidden_size // cfg["qwen3"].num_attention_heads
    qwen2 = load_file(tiny_model("qwen2") / "model.safetensors")
    assert {"q_proj", "k_proj", "v_proj"} == {n.split(".")[-2] for n in qwen2 if n.endswith("proj.bias")}
    qwen3 = load_file(tiny_model("qwen3") / "model.safetensors")
    assert qwen3["model.layers.0.self_attn.q_norm.weight"].shape == (32,)


def test_llama3_rope_scaling_is_read_and_changes_outputs(tiny_model, tmp_path):
    path = tiny_model("llama")
    assert "rope_scaling" in json.loads((path / "config.json").read_text())  # hub spelling on disk
    rope = AutoConfig.from_pretrained(path).rope_parameters
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0 and rope["original_max_position_embeddings"] == 64
    unscaled = make_tiny_model(tmp_path, "llama", rope_scaling=None)
    assert AutoConfig.from_pretrained(unscaled).rope_parameters["rope_type"] == "default"
    ids = torch.arange(10, 110).unsqueeze(0)
    with torch.no_grad():
        a, b = _load(path)[0](ids).logits[0], _load(unscaled)[0](ids).logits[0]
    torch.testing.assert_close(a[0], b[0])  # position 0 is unrotated: same weights otherwise
    assert (a[1:] - b[1:]).abs().amax(-1).min() > 1e-3


def test_same_arguments_give_identical_files(tiny_model, tmp_path):
    again = make_tiny_model(tmp_path / "a", "qwen2")
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (tiny_model("qwen2") / name).read_bytes(), name
    other = load_file(make_tiny_model(tmp_path / "b", "qwen2", seed=1) / "model.safetensors")
    assert not torch.equal(
        other["model.embed_tokens.weight"], load_file(again / "model.safetensors")["model.embed_tokens.weight"]
    )


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # the two tokenizer pipelines
def test_tokenizer_round_trips_bytes_and_matches_tokenizer_json(tiny_model, arch):
    path = tiny_model(arch)
    tok = AutoTokenizer.from_pretrained(path)
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    config = json.loads((path / "config.json").read_text())
    assert len(tok) == raw.get_vocab_size() == config["vocab_size"]
    assert [tok.pad_token, tok.bos_token, tok.eos_token] == [SPECIAL_TOKENS[i] for i in (PAD_ID, BOS_ID, IM_END_ID)]
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (
        config["pad_token_id"],
        config["bos_token_id"],
        config["eos_token_id"],
    )
    generation = json.loads((path / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (BOS_ID, IM_END_ID)
    for text in TEXTS:
        ids = tok(text).input_ids
        assert ids == raw.encode(text).ids and ids[0] == BOS_ID
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert all(i >= len(SPECIAL_TOKENS) for i in ids[1:])  # plain text never yields special tokens
    assert len(tok(" return value").input_ids) < 1 + len(" return value")  # merges learned beyond single bytes


def test_chat_template_renders_chatml(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model("llama"))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "hi 🙂"}]},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    bos, start, end = (SPECIAL_TOKENS[i] for i in (BOS_ID, IM_START_ID, IM_END_ID))
    assert text == f"{bos}{start}system\nBe brief.{end}\n{start}user\nhi 🙂{end}\n{start}assistant\n"
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids.count(BOS_ID) == 1 and ids.count(IM_START_ID) == 3 and ids.count(IM_END_ID) == 2
    assert not tok.apply_chat_template(messages, tokenize=False).endswith("assistant\n")


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_decoding_is_not_degenerate_and_well_separated(tiny_model, arch):
    path = tiny_model(arch)
    model = _load(path)[0]
    prompts = torch.randint(len(SPECIAL_TOKENS), 2048, (8, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=24,
            min_new_tokens=24,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=PAD_ID,
        )
    new = out.sequences[:, prompts.shape[1] :]
    for row in new:
        assert len(set(row.tolist())) >= 12, row  # not stuck on one token or a short loop
    top2 = torch.stack(out.logits, 1).float().topk(2, -1).values
    assert (top2[..., 0] - top2[..., 1]).median() > 0.1


def test_vocab_32000_is_reachable():
    assert train_tokenizer(32000).get_vocab_size() == 32000


@pytest.mark.parametrize(
    "overrides, problem",
    [
        (dict(arch="gpt2"), "arch"),
        (dict(hidden_sizes=8), "hidden_sizes"),
        (dict(vocab_size=100), "vocab_size"),
        (dict(num_key_value_heads=3), "num_key_value_heads"),
        (dict(hidden_size=66), "hidden_size"),
        (dict(dtype="float64"), "dtype"),
        (dict(seed=-1), "seed"),
    ],
)
def test_bad_arguments_raise_value_error(tmp_path, overrides, problem):
    with pytest.raises(ValueError, match=problem):
        make_tiny_model(tmp_path, **overrides)
    assert not any(tmp_path.iterdir())  # validation happens before anything is written


def test_cli_writes_overrides(tmp_path, capsys):
    main([str(tmp_path), "--arch", "qwen3", "--set", "num_hidden_layers=1", "--set", "dtype=bfloat16"])
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["dtype"] == "bfloat16" and config["model_type"] == "qwen3"
    assert {t.dtype for t in load_file(tmp_path / "model.safetensors").values()} == {torch.bfloat16}
    assert str(tmp_path) in capsys.readouterr().out
