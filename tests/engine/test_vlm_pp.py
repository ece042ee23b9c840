"""Pipeline parallelism of the vision-language models, PP=2 on CPU (gloo): the vision tower on the first stage's rank,
which embeds each step's images with its tokens and sends hidden states on as any first stage does; M-RoPE's [3, T]
positions reach both stages with the step. LLaVA and Qwen2-VL (its image runs split across prefill chunks) give
transformers' greedy 32 tokens, their logprobs and the prompt's logprobs (fp32, 1e-4) with one and two images beside
a text-only request and an image request with a LoRA adapter (PEFT's) in one batch; no KV block stays in use and no
worker is left. The second stage builds no tower and
reads none of its weights."""

import pytest
import torch
from lora_adapters import make_adapter
from peft import PeftModel
from references import reference_vlm

from tests.engine.test_llava import random_image
from tests.engine.test_vlm_lora import ADAPTERS, assert_equal, outputs
from tests.engine.test_vlm_tp import NEW_TOKENS, as_prompt, family
from tiffin import LLM, LoRARequest
from tiffin.engine.distributed.pipeline import PipelineParallel
from tiffin.engine.models import loader
from tiffin.engine.models.layers import rename_prefix
from tiffin.engine.models.loader import build_model, get_model_config
from tiffin.engine.models.registry import get_architecture

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]


@pytest.fixture(scope="module")
def images():
    """LLaVA resizes each to 56 px; Qwen2-VL makes 9 x 7, 4 x 15 and 8 x 2 image tokens of them."""
    return [random_image(1, (70, 90)), random_image(2, (120, 30)), random_image(3, (20, 64))]


@pytest.mark.parametrize("name", ["llava", "qwen2_vl"])
def test_pp2_equals_transformers(request, images, name, tmp_path):
    """One image, a text-only prompt, two images of other sizes and an image prompt with a LoRA adapter (PEFT's on
    transformers' model: each stage holds its layers' part) in one batch over two stages."""
    module, path, engine_args = family(request, name)
    cases = [(module.ONE, images[:1]), (module.TEXT, []), (module.TWO, images[1:]), (module.ONE, images[1:2])]
    hf = module.load_hf(path)
    want = [reference_vlm(hf[0], module.processed(hf, text, imgs), NEW_TOKENS) for text, imgs in cases[:3]]
    adapter = make_adapter(path, tmp_path / "lm", seed=0, model=hf[0], **ADAPTERS["lm"])
    peft = PeftModel.from_pretrained(hf[0], str(adapter)).eval()
    want.append(reference_vlm(peft, module.processed(hf, *cases[3]), NEW_TOKENS))
    kwargs = dict(dtype="float32", pipeline_parallel_size=2, distributed_timeout=60, enable_lora=True, max_loras=1)
    llm = LLM(path, **kwargs, **engine_args)
    try:
        runner = llm.llm_engine.model_runner
        workers = runner.group.procs
        assert runner.encoder is not None and runner.model.holds_vision
        prompts = [as_prompt(module, text, imgs) for text, imgs in cases]
        assert_equal(outputs(llm, prompts, [None] * 3 + [LoRARequest("lm", 1, str(adapter))]), want)
        assert llm.llm_engine.stats().kv_blocks_used == 0
    finally:
        llm.shutdown()
    assert workers and not any(p.is_alive() for p in workers)


@pytest.mark.parametrize("name", ["llava", "qwen2_vl"])
def test_the_second_stage_holds_and_reads_no_tower(request, name, monkeypatch):
    """Stage 1 of 2 builds its layers, the norm and head, and reads only their weights; stage 0 builds the tower
    and its layers and reads their weights whole."""
    monkeypatch.setenv("TIFFIN_CPU_FP32_GEMM", "mkl")  # plain weights kept, not prepacked for oneDNN
    _, path, _ = family(request, name)
    config = get_model_config(path)
    read = []
    weights = loader.checkpoint_weights  # each key read recorded: its `skip` said no
    monkeypatch.setattr(loader, "checkpoint_weights", lambda p, skip: weights(p, lambda k: skip(k) or read.append(k)))
    build = lambda pp: dict(build_model(config, path, torch.device("cpu"), 64, "torch", pp=pp).named_parameters())
    whole = build(PipelineParallel(0, 1))
    stages = []
    for rank in range(2):
        read.clear()
        stages.append((build(PipelineParallel(rank, 2)), list(read)))
    model = get_architecture(config.architecture).model
    vision = tuple(f"{m}." for m in model.vision_modules)
    of_tower = lambda names: {n for n in names if rename_prefix(n, model.checkpoint_prefixes).startswith(vision)}
    (first, first_read), (second, second_read) = stages
    assert of_tower(whole) and of_tower(first) == of_tower(whole) and not of_tower(second)
    assert all(torch.equal(stage[n], whole[n]) for stage in (first, second) for n in stage)
    assert set(first) | set(second) == set(whole)
    assert of_tower(first_read) and not of_tower(second_read)
