"""Multi-LoRA in the engine: greedy outputs equal PEFT's (the adapter applied to the transformers model) for one
generate call interleaving the base model and several adapters, on a float32 base and on quantized bases (AWQ,
compressed-tensors INT8 and FP8);
scheduling within the device slots; prefix caching keyed by adapter content; runtime add/remove; and every
kind of adapter the loader must refuse."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from compressed_checkpoints import write_compressed
from lora_adapters import ADAPTERS, PeftReference, make_adapter, set_config
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from tiffin import LLM, LoRARequest, SamplingParams
from tiffin.engine.lora.registry import LoRARegistry
from tiffin.tiny import make_tiny_model

NEW_TOKENS = 24
PROMPT_LENS = (3, 17, 40, 9, 33, 21, 5, 60, 12, 27, 48, 7)
AWQ_FIXTURE = Path(__file__).parents[1] / "fixtures" / "quant" / "awq-g64"
AWQ_REFERENCE = AWQ_FIXTURE / "reference" / "dequantized.safetensors"  # AutoAWQ's own dequantized weights
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def prompts_for(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def build_adapters(base, root: Path, model) -> dict[str, Path]:
    """The three ADAPTERS plus one whose config says fan_in_fan_out (which PEFT, and tiffin, ignore for Linear
    layers: A and B keep their shapes)."""
    dirs = {
        name: make_adapter(base, root / name, seed=i, model=model, **kw)
        for i, (name, kw) in enumerate(ADAPTERS.items())
    }
    dirs["fan-in-fan-out"] = make_adapter(
        base, root / "fan-in-fan-out", seed=7, model=model, r=8, lora_alpha=8, target_modules=["up_proj", "o_proj"]
    )
    set_config(dirs["fan-in-fan-out"], fan_in_fan_out=True)
    return dirs


@pytest.fixture(scope="module")
def fp_case(tiny_model, tmp_path_factory):
    base = tiny_model("llama")
    root = tmp_path_factory.mktemp("adapters")
    dirs = build_adapters(base, root, AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32))
    ref = PeftReference(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), dirs)
    return base, dirs, ref, prompts_for(AutoConfig.from_pretrained(base).vocab_size)


def requests_for(dirs: dict[str, Path]) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(dirs.items())}


def interleaved(prompts, dirs) -> list[str | None]:
    names = [None, *dirs]
    return [names[i % len(names)] for i in range(len(prompts))]


def record_steps(llm: LLM) -> list[set]:
    """Distinct adapters of every step the model runner executes."""
    slots = llm.llm_engine.model_runner.lora_slots
    steps, stage = [], slots.stage

    def spy(loras, num_tokens, add):
        steps.append({(m.identity if m else None) for m in loras})
        return stage(loras, num_tokens, add)

    slots.stage = spy
    return steps


@pytest.mark.parametrize(
    "engine_args",
    [dict(max_loras=4), dict(max_loras=2, max_cpu_loras=2), dict(max_loras=3, max_num_batched_tokens=29)],
    ids=["4-slots", "2-slots-2-cached", "3-slots-chunked-prefill"],
)
def test_greedy_matches_peft_interleaved(fp_case, engine_args):
    base, dirs, ref, prompts = fp_case
    assign = interleaved(prompts, dirs)
    expected = [ref.generate(p, a, NEW_TOKENS) for p, a in zip(prompts, assign)]
    base_outputs = [ref.generate(p, None, NEW_TOKENS) for p in prompts]
    assert all(e != b for e, b, a in zip(expected, base_outputs, assign) if a), "an adapter changes nothing"

    llm = LLM(base, dtype="float32", enable_lora=True, **engine_args)
    steps = record_steps(llm)
    reqs = requests_for(dirs)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        GREEDY,
        use_tqdm=False,
        lora_request=[reqs[a] if a else None for a in assign],
    )
    got = [o.outputs[0].token_ids for o in outs]
    wrong = [(i, a) for i, (a, x, y) in enumerate(zip(assign, got, expected)) if x != y]
    assert not wrong, f"prompts whose tokens differ from PEFT's (index, adapter): {wrong}"
    slots = engine_args["max_loras"]
    assert max(len(s - {None}) for s in steps) <= slots
    assert any(None in s and len(s) >= 3 for s in steps), "base and several adapters never shared a step"
    stats = llm.llm_engine.stats()
    assert stats.kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0


def awq_base(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    """The AWQ fixture and transformers holding AutoAWQ's own dequantized weights."""
    raw = json.loads((AWQ_FIXTURE / "config.json").read_text())
    raw.pop("quantization_config")
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw), dtype=torch.float32)
    state = {k: v.float() for k, v in load_file(AWQ_REFERENCE).items()}
    state.update(
        {
            k: v.float()
            for k, v in load_file(AWQ_FIXTURE / "model.safetensors").items()
            if not k.endswith((".qweight", ".qzeros", ".scales"))
        }
    )
    hf.load_state_dict(state, strict=True)
    return AWQ_FIXTURE, hf


def compressed_base(name: str, tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    """A compressed-tensors checkpoint of a bf16 tiny llama (its scales bf16, held exactly) and transformers holding
    its dequantized weights."""
    base = make_tiny_model(tmp_path / "base", "llama", dtype="bfloat16")
    path = write_compressed(base, tmp_path / name, name)
    return path, AutoModelForCausalLM.from_pretrained(path / "reference", dtype=torch.float32)


@pytest.mark.parametrize("base", ["awq-g64", "w8a8-int", "fp8-channel"])
def test_greedy_matches_peft_on_quantized_bases(base, tmp_path):
    """Adapters over quantized layers (AWQ; compressed-tensors INT8 and FP8): the reference is transformers holding
    the format's own dequantized weights."""
    if base == "awq-g64" and not AWQ_REFERENCE.exists():
        pytest.skip("the AWQ fixture is not present")
    path, hf = awq_base(tmp_path) if base == "awq-g64" else compressed_base(base, tmp_path)
    vocab = hf.config.vocab_size
    dirs = build_adapters(None, tmp_path, hf)
    ref = PeftReference(hf, dirs)
    prompts = prompts_for(vocab, seed=1)[:8]
    assign = interleaved(prompts, dirs)
    expected = [ref.generate(p, a, NEW_TOKENS) for p, a in zip(prompts, assign)]
    assert all(e != ref.generate(p, None, NEW_TOKENS) for p, e, a in zip(prompts, expected, assign) if a)

    llm = LLM(str(path), dtype="float32", kernel_backend="torch", enable_lora=True, max_loras=4,
              cpu_quant_compute="exact")  # fmt: skip
    method = type(llm.llm_engine.model_runner.model.model.layers[0].self_attn.qkv_proj.method).__name__
    assert method == ("AWQLinearMethod" if base == "awq-g64" else "CompressedTensorsLinearMethod")
    reqs = requests_for(dirs)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        GREEDY,
        use_tqdm=False,
        lora_request=[reqs[a] if a else None for a in assign],
    )
    wrong = [(i, a) for i, (a, o, e) in enumerate(zip(assign, outs, expected)) if o.outputs[0].token_ids != e]
    assert not wrong, f"prompts whose tokens differ from PEFT's (index, adapter): {wrong}"


def test_fused_qkv_adapter_equals_split_one(fp_case, tmp_path):
    """An adapter that names the fused `qkv_proj` / `gate_up_proj` (one A for all slices, B stacked) equals the
    PEFT adapter with that A on q, k and v and B split among them."""
    base, dirs, _, prompts = fp_case
    split = make_adapter(
        base,
        tmp_path / "split",
        seed=11,
        r=4,
        lora_alpha=4,
        target_modules=["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"],
    )
    tensors = load_file(split / "adapter_model.safetensors")
    fused = {}
    for key in tensors:
        for parts, name in ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj")):
            if parts[0] in key:
                keys = [key.replace(parts[0], p) for p in parts]
                if ".lora_A." in key:
                    tensors_a = [tensors[k] for k in keys]
                    for a in tensors_a[1:]:  # give every slice the first slice's A, as a fused A does
                        a.copy_(tensors_a[0])
                    fused[key.replace(parts[0], name)] = tensors_a[0].clone()
                else:
                    fused[key.replace(parts[0], name)] = torch.cat([tensors[k] for k in keys])
    save_file(tensors, split / "adapter_model.safetensors")
    shutil.copytree(split, tmp_path / "fused")
    save_file(fused, tmp_path / "fused" / "adapter_model.safetensors")
    llm = LLM(base, dtype="float32", enable_lora=True)
    params = [{"prompt_token_ids": p} for p in prompts[:4]]
    a = llm.generate(params, GREEDY, use_tqdm=False, lora_request=LoRARequest("split", 1, str(split)))
    b = llm.generate(params, GREEDY, use_tqdm=False, lora_request=LoRARequest("fused", 2, str(tmp_path / "fused")))
    c = llm.generate(params, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert [o.outputs[0].token_ids for o in a] != [o.outputs[0].token_ids for o in c]


def test_scheduler_keeps_adapters_within_slots(fp_case):
    """Four adapters, one slot: requests for the other adapters wait (base requests still run alongside), and
    every request still finishes with PEFT's output."""
    base, dirs, ref, prompts = fp_case
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=1)
    steps = record_steps(llm)
    assign = interleaved(prompts[:10], dirs)
    reqs = requests_for(dirs)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts[:10]],
        GREEDY,
        use_tqdm=False,
        lora_request=[reqs[a] if a else None for a in assign],
    )
    assert max(len(s - {None}) for s in steps) == 1
    assert any(None in s and len(s) == 2 for s in steps)
    for p, a, o in zip(prompts, assign, outs):
        assert o.outputs[0].token_ids == ref.generate(p, a, NEW_TOKENS)


def test_prefix_cache_keyed_by_adapter_content(fp_case, tmp_path):
    base, dirs, _, prompts = fp_case
    prompt = {"prompt_token_ids": prompts[7]}  # 60 tokens: three full blocks of 16
    llm = LLM(base, dtype="float32", enable_lora=True)
    a = LoRARequest("qv", 1, str(dirs["qv-r8"]))
    same_content = shutil.copytree(dirs["qv-r8"], tmp_path / "copy")
    run = lambda lora: llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=lora)[0]
    first = run(a)
    assert run(None).num_cached_tokens == 0  # the base model never reuses an adapter's KV
    assert run(LoRARequest("rs", 2, str(dirs["all-rslora-r16"]))).num_cached_tokens == 0
    again = run(a)
    assert again.num_cached_tokens == 48 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert run(LoRARequest("qv-copy", 3, str(same_content))).num_cached_tokens == 48  # same content, same KV
    # new weights behind a reused name and id (removed, rewritten, loaded again) never hit the old KV
    llm.llm_engine.remove_lora(3)
    make_adapter(base, same_content, seed=99, **ADAPTERS["qv-r8"])
    changed = run(LoRARequest("qv-copy", 3, str(same_content)))
    assert changed.num_cached_tokens == 0 and changed.outputs[0].token_ids != first.outputs[0].token_ids


def test_runtime_add_remove_list(fp_case):
    base, dirs, ref, prompts = fp_case
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=2, max_cpu_loras=3)
    engine = llm.llm_engine
    reqs = requests_for(dirs)
    assert engine.add_lora(reqs["qv-r8"]) and not engine.add_lora(reqs["qv-r8"])
    assert engine.add_lora(reqs["mlp-patterns"]) and engine.list_loras() == {1, 3}
    with pytest.raises(ValueError, match="already loaded"):
        engine.add_lora(LoRARequest("other-name", 1, str(dirs["qv-r8"])))
    with pytest.raises(ValueError, match="already loaded with lora_int_id 1"):
        engine.add_lora(LoRARequest("qv-r8", 9, str(dirs["qv-r8"])))
    for r in (reqs["all-rslora-r16"], reqs["fan-in-fan-out"]):  # the host cache keeps the 3 most recent
        engine.add_lora(r)
    assert engine.list_loras() == {3, 2, 4}

    # unloading an adapter whose requests are in flight: they finish, with its weights
    engine.add_request("a", {"prompt_token_ids": prompts[2]}, GREEDY, reqs["all-rslora-r16"])
    engine.add_request("b", {"prompt_token_ids": prompts[3]}, GREEDY)
    outputs = {}
    for _ in range(3):
        for out in engine.step():
            outputs[out.request_id] = out
    assert engine.remove_lora(2) and not engine.remove_lora(2) and engine.list_loras() == {3, 4}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    assert outputs["a"].outputs[0].token_ids == ref.generate(prompts[2], "all-rslora-r16", NEW_TOKENS)
    assert outputs["b"].outputs[0].token_ids == ref.generate(prompts[3], None, NEW_TOKENS)


def test_lora_needs_enable_lora(tiny_model, fp_case):
    llm = LLM(tiny_model("llama"), dtype="float32")
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate("hi", GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 1, str(fp_case[1]["qv-r8"])))
    with pytest.raises(ValueError, match="enable_lora"):
        llm.llm_engine.list_loras()
    assert llm.llm_engine.model_runner.model.model.layers[0].self_attn.qkv_proj.adapters is None


@pytest.mark.parametrize(
    "bad",
    [dict(lora_name="", lora_int_id=1), dict(lora_name="x", lora_int_id=0), dict(lora_name="x", lora_int_id=True)],
)
def test_lora_request_validation(bad):
    with pytest.raises(ValueError):
        LoRARequest(**bad)


@pytest.fixture(scope="module")
def loader(tiny_model):
    llm = LLM(tiny_model("llama"), dtype="float32", enable_lora=True, max_lora_rank=16)
    return llm.llm_engine.lora_registry


def _rewrite(path: Path, fn) -> None:
    tensors = load_file(path / "adapter_model.safetensors")
    save_file(fn(tensors), path / "adapter_model.safetensors")


def _copy_layer_0_to_7(tensors: dict) -> dict:
    return {**tensors, **{k.replace("layers.0", "layers.7"): v.clone() for k, v in tensors.items() if "layers.0" in k}}


REFUSED = {
    # name: (LoraConfig kwargs, post-processing of the directory or None, error pattern)
    "dora": (dict(r=4, target_modules=["q_proj"], use_dora=True), None, "DoRA"),
    "modules-to-save": (dict(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]), None, "modules_to_save"),
    "embedding": (dict(r=4, target_modules=["embed_tokens"]), None, "embeddings"),
    "lm-head": (dict(r=4, target_modules=["lm_head"]), None, "lm_head is not supported"),
    "lora-bias": (dict(r=4, target_modules=["q_proj"], lora_bias=True), None, "LoRA bias"),
    "bias-all": (dict(r=4, target_modules=["q_proj"]), lambda p: set_config(p, bias="all"), "bias 'all'"),
    "rank-too-large": (dict(r=32, target_modules=["q_proj"]), None, "exceeds max_lora_rank 16"),
    "rank-pattern-too-large": (
        dict(r=4, target_modules=["q_proj"], rank_pattern={"q_proj": 64}),
        None,
        "exceeds max_lora_rank",
    ),
    "wrong-input-shape": (
        dict(r=4, target_modules=["q_proj"]),
        lambda p: _rewrite(p, lambda t: {k: v[:, :32].contiguous() if "lora_A" in k else v for k, v in t.items()}),
        "do not fit the base layer",
    ),
    "wrong-output-shape": (
        dict(r=4, target_modules=["v_proj"]),
        lambda p: _rewrite(p, lambda t: {k: torch.cat([v, v]) if "lora_B" in k else v for k, v in t.items()}),
        "do not fit",
    ),
    "rank-mismatch": (dict(r=4, target_modules=["q_proj"]), lambda p: set_config(p, r=8), "do not have the rank 8"),
    "missing-b": (
        dict(r=4, target_modules=["q_proj"]),
        lambda p: _rewrite(p, lambda t: {k: v for k, v in t.items() if "lora_B" not in k}),
        "no lora_B",
    ),
    "extra-layer": (
        dict(r=4, target_modules=["q_proj"]),
        lambda p: _rewrite(p, _copy_layer_0_to_7),
        "base model does not have",
    ),
    "pickle-only": (
        dict(r=4, target_modules=["q_proj"]),
        lambda p: (p / "adapter_model.safetensors").rename(p / "adapter_model.bin"),
        "only safetensors",
    ),
    "no-config": (
        dict(r=4, target_modules=["q_proj"]),
        lambda p: (p / "adapter_config.json").unlink(),
        "no adapter_config.json",
    ),
    "not-json": (
        dict(r=4, target_modules=["q_proj"]),
        lambda p: (p / "adapter_config.json").write_text("{r: 4"),
        "not valid JSON",
    ),
    "not-safetensors": (
        dict(r=4, target_modules=["q_proj"]),
        lambda p: (p / "adapter_model.safetensors").write_bytes(b"\x80\x04pickle"),
        "not a valid",
    ),
    "not-lora": (dict(r=4, target_modules=["q_proj"]), lambda p: set_config(p, peft_type="IA3"), "not LORA"),
}


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_loader_refuses(case, loader, tiny_model, tmp_path):
    kwargs, post, pattern = REFUSED[case]
    path = make_adapter(tiny_model("llama"), tmp_path / case, seed=0, **kwargs)
    if post:
        post(path)
    with pytest.raises(ValueError, match=pattern):
        loader.load(LoRARequest(case, 1, str(path)))
    assert loader.cached_ids() == set()


def test_loader_refuses_missing_directory(loader, tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        loader.load(LoRARequest("gone", 1, str(tmp_path / "nowhere")))


def test_loader_folds_scaling_and_pads_fused_slices(loader, fp_case):
    """What lands in the slots: per-slice A rows at `slice * max_rank`, B scaled by alpha/r (alpha/sqrt(r) for
    rsLoRA) with patterns applied per module, and nothing where the adapter has no weights."""
    _, dirs, _, _ = fp_case
    assert isinstance(loader, LoRARegistry)
    tensors = load_file(dirs["mlp-patterns"] / "adapter_model.safetensors")
    model = loader.load(LoRARequest("p", 1, str(dirs["mlp-patterns"])))
    key = "base_model.model.model.layers.{}.{}.lora_{}.weight"
    a, b = model.layers["model.layers.1.mlp.gate_up_proj"][0]  # rank_pattern 12, alpha 8
    assert torch.equal(a, tensors[key.format(1, "mlp.gate_proj", "A")])
    torch.testing.assert_close(b, tensors[key.format(1, "mlp.gate_proj", "B")] * 8 / 12)
    assert model.layers["model.layers.1.mlp.gate_up_proj"][1] is None  # up_proj not targeted
    _, b = model.layers["model.layers.0.mlp.down_proj"][0]  # alpha_pattern 3, r 4
    torch.testing.assert_close(b, tensors[key.format(0, "mlp.down_proj", "B")] * 3 / 4)
    qkv = model.layers["model.layers.0.self_attn.qkv_proj"]
    assert qkv[0] is None and qkv[2] is None and qkv[1][0].shape == (2, 64)  # k_proj at rank_pattern 2
    rs = loader.load(LoRARequest("rs", 2, str(dirs["all-rslora-r16"])))
    _, b = rs.layers["model.layers.0.self_attn.o_proj"][0]
    rs_tensors = load_file(dirs["all-rslora-r16"] / "adapter_model.safetensors")
    torch.testing.assert_close(b, rs_tensors[key.format(0, "self_attn.o_proj", "B")] * 6 / 16**0.5)


@pytest.mark.slow
def test_triton_kernels_in_the_engine(fp_case, monkeypatch):
    """The engine on the Triton path (attention and LoRA kernels under the interpreter) still gives PEFT's tokens."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    base, dirs, ref, prompts = fp_case
    assign = interleaved(prompts[:5], dirs)
    reqs = requests_for(dirs)
    llm = LLM(base, dtype="float32", enable_lora=True, kernel_backend="triton")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts[:5]],
        params,
        use_tqdm=False,
        lora_request=[reqs[a] if a else None for a in assign],
    )
    for p, a, o in zip(prompts, assign, outs):
        assert o.outputs[0].token_ids == ref.generate(p, a, NEW_TOKENS)[:6], a
