"""LoRA on the language model of a vision-language model (vLLM's rule: the vision tower and projector take none). For
LLaVA and Qwen2-VL (M-RoPE, its image runs split across prefill chunks) greedy 32 tokens, their logprobs and the
prompt's logprobs equal PEFT's on transformers' model (fp32, 1e-4) with images in the prompts, two adapters and the
base model in one batch; an adapter that also targets the tower and projector serves its language-model part (the
rest ignored, with a warning naming it) and one that targets only them is refused by name; the prefix cache's block
hashes hold the adapter beside the images; adapters load and unload while image requests run."""

import logging
import shutil

import numpy as np
import pytest
import torch
from lora_adapters import make_adapter
from peft import PeftModel
from references import reference_vlm
from safetensors.torch import load_file, save_file

from tests.engine import test_llava, test_qwen2_vl
from tests.engine.test_llava import random_image
from tests.engine.test_vlm_tp import NEW_TOKENS, PARAMS, as_prompt
from tiffin import LLM, LoRARequest, SamplingParams
from tiffin.engine.core.block_manager import BlockManager

LANGUAGE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name: (its test module: prompts, `load_hf`, `processed`; its checkpoint's fixture; engine arguments; the tower's
# and projector's module names (transformers') that the "mixed" adapter targets beside the language model's)
FAMILIES = {
    "llava": (test_llava, "tiny_llava", {}, ["linear_1"]),  # and the CLIP tower's own q_proj, v_proj
    "qwen2_vl": (test_qwen2_vl, "tiny_qwen2_vl", {"max_num_batched_tokens": 40}, ["qkv", "fc1", "mlp.0"]),
}
ADAPTERS = {  # name -> LoraConfig kwargs, the tower's targets added to "mixed"'s
    "lm": dict(r=8, lora_alpha=16, target_modules=rf".*(language_model|text_model)\..*\.({'|'.join(LANGUAGE)})"),
    "mixed": dict(r=4, lora_alpha=6, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"]),
}
TOWER_PREFIXES = {"llava": ("model.vision_tower.", "model.multi_modal_projector."), "qwen2_vl": ("model.visual.",)}
TOWER_ONLY = {"llava": r".*vision_tower.*\.q_proj", "qwen2_vl": r".*visual.*\.qkv"}


def zero_tower(src, dst, prefixes: tuple[str, ...]):
    """A copy of adapter `src` whose modules under `prefixes` (transformers' names of the tower and projector) add
    nothing: what serving its language-model part alone means, as PEFT computes it."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "adapter_model.safetensors")
    tower = lambda key: key.removeprefix("base_model.model.").startswith(prefixes)
    zeroed = {k: torch.zeros_like(v) if tower(k) and ".lora_B." in k else v for k, v in tensors.items()}
    assert all(any(tower(k) and p in k for k in tensors) for p in prefixes)
    save_file(zeroed, dst / "adapter_model.safetensors")
    return dst


class Case:
    """A family's checkpoint, adapters, transformers' model holding them (PEFT) and one engine."""

    def __init__(self, request, name: str, root):
        module, fixture, engine_args, tower = FAMILIES[name]
        self.name, self.module, self.path = name, module, request.getfixturevalue(fixture)
        self.hf = module.load_hf(self.path)
        kwargs = {
            **ADAPTERS,
            "mixed": {**ADAPTERS["mixed"], "target_modules": ["q_proj", "v_proj", "down_proj", *tower]},
        }
        self.dirs = {
            a: make_adapter(self.path, root / a, seed=i, model=self.hf[0], **kw)
            for i, (a, kw) in enumerate(kwargs.items())
        }
        self.dirs["mixed-lm"] = zero_tower(self.dirs["mixed"], root / "mixed-lm", TOWER_PREFIXES[name])
        self.dirs["tower"] = make_adapter(self.path, root / "tower", seed=9, model=self.hf[0], r=4, lora_alpha=4,
                                          target_modules=TOWER_ONLY[name])  # fmt: skip
        self.peft = PeftModel.from_pretrained(self.hf[0], str(self.dirs["lm"]), adapter_name="lm")
        for a in ("mixed", "mixed-lm"):
            self.peft.load_adapter(str(self.dirs[a]), adapter_name=a)
        self.peft.eval()
        self.requests = {a: LoRARequest(a, i + 1, str(d)) for i, (a, d) in enumerate(self.dirs.items())}
        self.llm = LLM(self.path, dtype="float32", enable_lora=True, max_loras=2, **engine_args)

    def logits(self, text: str, images: list):
        """adapter -> PEFT's logits of the prompt with it."""
        inputs = self.module.processed(self.hf, text, images)

        def of(adapter: str) -> torch.Tensor:
            self.peft.set_adapter(adapter)
            with torch.inference_mode():
                return self.peft(**inputs).logits

        return of

    def expected(self, text: str, images: list, adapter: str | None) -> tuple:
        """PEFT's greedy tokens, their logprobs and the prompt's logprobs with `adapter` (None: the base model)."""
        inputs = self.module.processed(self.hf, text, images)
        if adapter is None:
            with self.peft.disable_adapter():
                return reference_vlm(self.peft, inputs, NEW_TOKENS)
        self.peft.set_adapter(adapter)
        return reference_vlm(self.peft, inputs, NEW_TOKENS)


@pytest.fixture(scope="module", params=list(FAMILIES))
def case(request, tmp_path_factory):
    case = Case(request, request.param, tmp_path_factory.mktemp(f"adapters-{request.param}"))
    yield case
    case.llm.shutdown()


@pytest.fixture(scope="module")
def images():
    return [random_image(1, (70, 90)), random_image(2, (120, 30)), random_image(3, (20, 64))]


def outputs(llm: LLM, prompts: list[dict], loras: list) -> list[tuple[list[int], list[float], list[float]]]:
    """Each request's greedy tokens, their logprobs and its prompt's logprobs (after the first token)."""
    got = []
    for out in llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=loras):
        c, ids = out.outputs[0], out.prompt_token_ids
        prompt = [lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]
        got.append((c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)], prompt))
    return got


def assert_equal(got: list, want: list) -> None:
    for (tokens, logprobs, prompt), (want_tokens, want_logprobs, want_prompt) in zip(got, want, strict=True):
        assert tokens == want_tokens
        np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-4, rtol=0)
        np.testing.assert_allclose(prompt, want_prompt, atol=1e-4, rtol=0)


def test_adapters_and_base_in_one_batch_equal_peft(case, images, caplog):
    """Two adapters and the base model over image prompts and a text prompt in one batch, at most two adapters in
    a step; the mixed adapter's tower and projector modules ignored with a warning naming them, its language-model
    part served (PEFT with those modules zeroed); each adapter changes the output."""
    m = case.module
    cases = [(m.ONE, images[:1], "lm"), (m.TWO, images[1:], "mixed"), (m.ONE, images[:1], None), (m.TEXT, [], "lm")]
    want = [case.expected(text, imgs, "mixed-lm" if a == "mixed" else a) for text, imgs, a in cases]
    assert want[0][0] != want[2][0], "the adapter changes nothing"
    assert not torch.allclose(*map(case.logits(m.TWO, images[1:]), ("mixed", "mixed-lm")), atol=1e-2), (
        "the tower's modules change nothing in PEFT"
    )
    with caplog.at_level(logging.WARNING, "tiffin.engine.lora.peft"):
        got = outputs(case.llm, [as_prompt(m, t, i) for t, i, _ in cases], [case.requests.get(a) for *_, a in cases])
    assert_equal(got, want)
    warned = [r.getMessage() for r in caplog.records if "'mixed'" in r.getMessage()]
    assert len(warned) == 1 and "vision tower or projector ignored" in warned[0]
    assert ("model.vision_tower." if case.name == "llava" else "model.visual.") in warned[0]
    assert case.llm.llm_engine.stats().kv_blocks_used == 0


def test_the_tower_holds_no_adapter_slots(case):
    """Adapters apply to the language model alone: the tower's and projector's layers have no slots."""
    slots = case.llm.llm_engine.model_runner.lora_slots
    model = case.llm.llm_engine.model_runner.model
    vision = tuple(f"{name}." for name in model.vision_modules)
    tower = [m for name, m in model.named_modules() if name.startswith(vision) and hasattr(m, "adapters")]
    assert all(m.adapters is None for m in tower)
    assert tower or case.name == "qwen2_vl"  # CLIP's fused qkv_proj is a Linear; Qwen2-VL's tower has torch's alone
    assert slots.layers and not any(name.startswith(vision) for name in slots.layers)


def test_an_adapter_of_the_tower_alone_is_refused_by_name(case):
    engine = case.llm.llm_engine
    with pytest.raises(ValueError, match="'tower' targets only the vision tower or projector"):
        engine.add_lora(case.requests["tower"])
    assert engine.list_loras() <= {1, 2, 3}


def test_block_hashes_hold_the_adapter_beside_the_image(case, images):
    """The same image prompt with each adapter and without: no two share a block hash; the same adapter again
    reuses its blocks (a prefix hit) and gives the same tokens."""
    engine, m = case.llm.llm_engine, case.module
    prompt = as_prompt(m, m.ONE, images[2:])
    hashes = []
    for i, adapter in enumerate(["lm", "mixed", None]):
        engine.add_request(f"h{i}", prompt, SamplingParams(max_tokens=1), case.requests.get(adapter))
        seq = engine.requests[f"h{i}"].seqs[0]
        assert seq.images and seq.images[0].offset < 16  # the first block holds image placeholders
        hashes.append(set(BlockManager(64, 16)._hashes(seq, seq.num_tokens // 16)))
        engine.abort_request(f"h{i}")
    assert all(hashes) and not hashes[0] & hashes[1] and not hashes[0] & hashes[2] and not hashes[1] & hashes[2]
    while engine.has_unfinished_requests():
        engine.step()
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    first, again = (
        case.llm.generate(prompt, params, use_tqdm=False, lora_request=case.requests["lm"])[0] for _ in "ab"
    )
    assert again.num_cached_tokens >= 16 and again.outputs[0].token_ids == first.outputs[0].token_ids


def test_adapters_load_and_unload_while_image_requests_run(case, images):
    """An adapter added ahead, an image request running with it, the adapter removed mid-flight: the request
    finishes with its weights (PEFT's tokens), the base request beside it with the base model's."""
    engine, m = case.llm.llm_engine, case.module
    lm = case.requests["lm"]
    engine.remove_lora(lm.lora_int_id)
    assert engine.add_lora(lm) and lm.lora_int_id in engine.list_loras()
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    engine.add_request("a", as_prompt(m, m.ONE, images[1:2]), params, lm)
    engine.add_request("b", as_prompt(m, m.ONE, images[1:2]), params)
    done = {}
    for _ in range(3):
        done.update((out.request_id, out) for out in engine.step())
    assert engine.remove_lora(lm.lora_int_id) and lm.lora_int_id not in engine.list_loras()
    while engine.has_unfinished_requests():
        done.update((out.request_id, out) for out in engine.step())
    assert done["a"].outputs[0].token_ids == case.expected(m.ONE, images[1:2], "lm")[0]
    assert done["b"].outputs[0].token_ids == case.expected(m.ONE, images[1:2], None)[0]
    assert engine.stats().kv_blocks_used == 0


# transformers' module names today -> the hub's older ones, which adapters trained on older transformers carry
HUB_NAMES = {
    "llava": {"model.language_model.": "language_model.model.", "model.vision_tower.": "vision_tower.vision_model."},
    "qwen2_vl": {"model.language_model.": "model.", "model.visual.": "visual."},
}


def test_adapters_with_the_hubs_module_names_load_alike(case, tmp_path):
    """The mixed adapter with its modules named as older transformers named them: the same weights in the same
    layers, the same modules ignored."""
    renamed = shutil.copytree(case.dirs["mixed"], tmp_path / "hub")
    tensors = load_file(renamed / "adapter_model.safetensors")
    rename = lambda key: next(
        (key.replace(new, old, 1) for new, old in HUB_NAMES[case.name].items() if f"base_model.model.{new}" in key), key
    )
    save_file({rename(k): v for k, v in tensors.items()}, renamed / "adapter_model.safetensors")
    assert set(load_file(renamed / "adapter_model.safetensors")) != set(tensors)
    engine = case.llm.llm_engine
    want, got = (engine.load_lora(LoRARequest(n, 9, str(d))) for n, d in (("a", case.dirs["mixed"]), ("b", renamed)))
    assert want.layers.keys() == got.layers.keys() and want.layers
    for name, slices in want.layers.items():
        for x, y in zip(slices, got.layers[name], strict=True):
            assert (x is None) == (y is None) and (x is None or all(map(torch.equal, x, y)))
