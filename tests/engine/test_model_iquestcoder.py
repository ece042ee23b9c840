"""IQuestCoder: transformers serves it with its Llama implementation, so tiffin does too (one registry line).
Its tiny checkpoint uses gelu_pytorch_tanh, so greedy parity also covers an activation other than silu."""

import json

import torch
from transformers import AutoModelForCausalLM

from tiffin import LLM, SamplingParams
from tiffin.tiny import make_tiny_model

PROMPT_LENS = [1, 9, 31, 90]
NEW_TOKENS = 24


def test_greedy_matches_transformers(tmp_path):
    path = make_tiny_model(tmp_path, "llama", hidden_act="gelu_pytorch_tanh", head_dim=16)
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["IQuestCoderForCausalLM"], model_type="iquestcoder")
    (path / "config.json").write_text(json.dumps(config))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.generation_config.eos_token_id = None  # tiffin ignores eos below
    assert type(hf.config).__name__ == "IQuestCoderConfig" and hf.config.hidden_act == "gelu_pytorch_tanh"
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, config["vocab_size"], (n,), generator=g).tolist() for n in PROMPT_LENS]
    expected = []
    for p in prompts:
        ids = torch.tensor([p])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
        expected.append(out[0, len(p) :].tolist())
    llm = LLM(str(path), dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
