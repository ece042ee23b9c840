"""Tensor parallelism of the vision-language models, TP=2: the language model sharded as a text model is, the vision
tower on rank 0 alone, which sends each step's image embeddings with the step. On CPU (gloo): LLaVA, Idefics3 /
SmolVLM, Qwen2-VL (M-RoPE) and Qwen2.5-VL give transformers' greedy 32 tokens, their logprobs and the prompt's
logprobs (fp32, 1e-4) on images of several sizes, two in one prompt, beside a text-only request in one batch
(Idefics3's and Qwen2-VL's image runs split across prefill chunks); no KV block stays in use and no worker is left.
Under the CUDA emulation (Triton under the interpreter, each rank capturing decode graphs, the tower eager on rank
0): the same for Qwen2-VL, its decode steps replayed from graphs on both ranks."""

import numpy as np
import pytest
import torch
from references import reference_vlm

from tests.engine import test_idefics3, test_llava, test_qwen2_vl
from tests.engine.test_llava import random_image
from tiffin import LLM, SamplingParams
from tiffin.engine.distributed.tensor_parallel import TensorParallel
from tiffin.engine.models.loader import build_model, get_model_config
from tiffin.engine.models.registry import get_architecture

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

NEW_TOKENS = 32
PARAMS = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0, prompt_logprobs=0)
# name: (its test module: prompts, `load_hf`, `processed`; its checkpoint's fixture; TP=2 engine arguments)
FAMILIES = {
    "llava": (test_llava, "tiny_llava", {}),
    "idefics3": (test_idefics3, "tiny_idefics3", {"max_num_batched_tokens": 40}),
    "qwen2_vl": (test_qwen2_vl, "tiny_qwen2_vl", {"max_num_batched_tokens": 40}),
    "qwen2_5_vl": (test_qwen2_vl, "tiny_qwen2_5_vl", {}),
}


@pytest.fixture(scope="module")
def images():
    """Sizes the families take differently: Idefics3's 3 x 3, 1 x 3 and 3 x 1 tiles, Qwen2-VL's 9 x 7, 4 x 15 and
    8 x 2 image tokens; LLaVA resizes each to 56 px."""
    return [random_image(1, (70, 90)), random_image(2, (120, 30)), random_image(3, (20, 64))]


def family(request, name: str) -> tuple:
    """(test module, checkpoint path, engine arguments) of family `name`."""
    module, fixture, engine_args = FAMILIES[name]
    return module, request.getfixturevalue(fixture), engine_args


def as_prompt(module, text: str, images: list) -> dict:
    return getattr(module, "as_prompt", test_llava.prompt)(text, images)


def outputs(llm: LLM, prompts: list[dict]) -> list[tuple[list[int], list[float], list[float]]]:
    """Each request's greedy tokens, their logprobs, and the logprobs of its prompt tokens after the first."""
    got = []
    for out in llm.generate(prompts, PARAMS, use_tqdm=False):
        c, ids = out.outputs[0], out.prompt_token_ids
        prompt = [lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]
        got.append((c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)], prompt))
    return got


def expected(module, path, cases: list[tuple[str, list]]) -> list[tuple[list[int], list[float], list[float]]]:
    """transformers' (`reference_vlm`) for each of `cases` (text, images)."""
    hf = module.load_hf(path)
    return [reference_vlm(hf[0], module.processed(hf, text, imgs), NEW_TOKENS) for text, imgs in cases]


def assert_as_expected(llm: LLM, module, cases: list[tuple[str, list]], want: list) -> None:
    """`cases` (text, images) in one batch: tokens equal to `want`'s, logprobs and prompt logprobs within 1e-4; then
    no KV block in use."""
    got = outputs(llm, [as_prompt(module, text, imgs) for text, imgs in cases])
    for (tokens, logprobs, prompt), (want_tokens, want_logprobs, want_prompt) in zip(got, want, strict=True):
        assert tokens == want_tokens
        np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-4, rtol=0)
        np.testing.assert_allclose(prompt, want_prompt, atol=1e-4, rtol=0)
    assert llm.llm_engine.stats().kv_blocks_used == 0


@pytest.mark.parametrize("name", FAMILIES)
def test_tp2_equals_transformers(request, images, name):
    """One image, a text-only prompt and two images of other sizes in one batch on two ranks; the images reach rank
    1 as rank 0's embeddings (rank 1 has no tower to encode them with)."""
    module, path, engine_args = family(request, name)
    cases = [(module.ONE, images[:1]), (module.TEXT, []), (module.TWO, images[1:])]
    llm = LLM(path, dtype="float32", tensor_parallel_size=2, distributed_timeout=60, **engine_args)
    try:
        workers = llm.llm_engine.model_runner.group.procs
        assert_as_expected(llm, module, cases, expected(module, path, cases))
    finally:
        llm.shutdown()
    assert workers and not any(p.is_alive() for p in workers)


@pytest.mark.parametrize("name", ["llava", "idefics3", "qwen2_vl"])
def test_other_ranks_hold_no_vision_tower(request, name, monkeypatch):
    """Rank 1 of 2 builds and loads the sharded language model alone (the checkpoint's tower weights skipped, not
    read); rank 0 builds the tower whole beside its shard."""
    monkeypatch.setenv("TIFFIN_CPU_FP32_GEMM", "mkl")  # plain weights kept, not prepacked for oneDNN
    _, path, _ = family(request, name)
    config = get_model_config(path)
    build = lambda *tp: dict(build_model(config, path, torch.device("cpu"), 64, "torch", *tp).named_parameters())
    whole, rank0, rank1 = build(), build(TensorParallel(0, 2)), build(TensorParallel(1, 2))
    vision_modules = get_architecture(config.architecture).model.vision_modules
    vision = [{n for n in params if n.startswith(vision_modules)} for params in (whole, rank0, rank1)]
    assert vision[0] and vision[1] == vision[0] and not vision[2]
    assert all(torch.equal(rank0[n], whole[n]) for n in vision[0])
    embed = "model.embed_tokens.weight"
    assert torch.equal(torch.cat([rank0[embed], rank1[embed]]), whole[embed])


@pytest.fixture(scope="module")
def cuda_cases(tiny_qwen2_vl) -> tuple[list, list]:
    """Qwen2-VL's cases for the CUDA path (16, 4 and 15 image tokens: a token costs under the interpreter) and
    transformers' outputs for them, computed before any emulation starts (its generation does not import under
    one)."""
    images = [random_image(i, size) for i, size in enumerate([(20, 64), (9, 9), (40, 24)])]
    m = test_qwen2_vl
    cases = [(m.ONE, images[:1]), (m.TEXT, []), (m.TWO, images[1:])]
    return cases, expected(m, tiny_qwen2_vl, cases)


def test_tp2_with_graphs_under_cuda_emulation_equals_transformers(tiny_qwen2_vl, cuda_cases, cuda_emulation):
    """Qwen2-VL on two emulated GPUs (NCCL's collectives run by gloo; the worker under an emulation of its own):
    both ranks warm up and capture their decode graphs; rank 0 runs the tower eagerly and sends the embeddings and
    M-RoPE's [3, T] positions with each prefill step (32-token chunks, cut inside images), which runs eagerly; the
    decode steps, at positions shifted by the images, replay graphs on both ranks. Tokens, logprobs and prompt
    logprobs equal to transformers'. The other families take the same tensor-parallel path (`VisionLanguageModel`,
    `tp_worker`): they are tested at TP=2 on CPU above and with graphs at TP=1 in their own modules."""
    cases, want = cuda_cases
    # few sequences and tokens: every rank warms up (its steps' all-reduces meet) and captures, each step costing
    # by its tokens and graph sizes under the interpreter
    kwargs = dict(dtype="float32", max_num_batched_tokens=32, max_num_seqs=2, max_model_len=80, num_kv_blocks=24)
    llm = LLM(tiny_qwen2_vl, device="cuda", tensor_parallel_size=2, distributed_timeout=120, **kwargs)
    try:
        assert sorted(llm.llm_engine.model_runner.decode_graphs.graphs) == [1, 2]
        assert_as_expected(llm, test_qwen2_vl, cases, want)
        replays = cuda_emulation.replays
    finally:
        llm.shutdown()
    assert replays >= NEW_TOKENS - 1 and cuda_emulation.worker_replays() == {1: replays}
