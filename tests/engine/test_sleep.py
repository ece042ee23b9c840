"""Sleep, wake and weight reload (tiffin.engine.sleep_mode): greedy outputs identical before and after sleeping at
level 1 and 2, also at TP=2; update_weights to a second checkpoint gives what a fresh engine on it gives; a checkpoint
that does not match is refused by name while the old weights serve on; requests while asleep are refused by name;
the served engine finishes the requests in flight first (or aborts them), and sleeps by itself when idle; on the CPU
sleep(2) hands the weights' memory back to the OS (RSS of a child process)."""

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf_files import write_gguf
from lora_adapters import make_adapter

from tiffin import LLM, SamplingParams
from tiffin.engine.async_llm_engine import AsyncLLMEngine
from tiffin.engine.errors import EngineAsleep, EngineBusy, EngineError
from tiffin.engine.lora.request import LoRARequest
from tiffin.engine.worker import model_runner
from tiffin.tiny import make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["The quick brown fox", "def main():", "Once upon a time, in a land"]
ENGINE = {"num_kv_blocks": 64, "max_model_len": 256}


def greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def checkpoints(tiny_model, tmp_path_factory):
    """The tiny llama, the same shapes with other random weights, and one with a wider MLP."""
    root = tmp_path_factory.mktemp("sleep")
    return (
        tiny_model("llama"),
        make_tiny_model(root / "other", seed=7),
        make_tiny_model(root / "wide", intermediate_size=256),
    )


@pytest.fixture(scope="module")
def references(checkpoints):
    """Each checkpoint's greedy outputs from a fresh engine."""
    outs = []
    for path in checkpoints[:2]:
        llm = LLM(str(path), **ENGINE)
        outs.append(greedy(llm))
        llm.shutdown()
    assert outs[0] != outs[1]
    return outs


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_then_wake_gives_the_same_outputs(checkpoints, references, level):
    llm = LLM(str(checkpoints[0]), enable_prefix_caching=True, **ENGINE)
    assert greedy(llm) == references[0]
    llm.sleep(level)
    assert llm.is_sleeping()
    runner = llm.llm_engine.model_runner
    assert not hasattr(runner, "kv_cache") and runner.model.model.layers[0].self_attn.k_cache.numel() == 0
    emptied = runner.model.model.embed_tokens.weight.numel() == 0
    assert emptied == (level == 2)
    with pytest.raises(EngineAsleep, match=f"asleep \\(sleep level {level}\\)"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert not llm.llm_engine.requests  # the refused request left nothing behind
    llm.wake_up()
    assert not llm.is_sleeping()
    assert greedy(llm) == references[0]
    assert greedy(llm) == references[0]  # from the prefix cache filled after the wake
    llm.shutdown()


QUANT = Path(__file__).parents[1] / "fixtures" / "quant"
LAYOUTS = {  # weights held plain, oneDNN-packed, as quantized blocks under the native int8 decoder, exact AWQ
    "fp32": ("tiny", {}),
    "bf16-packed": ("tiny", {"dtype": "bfloat16"}),
    "awq-int8-native": (QUANT / "awq-g64", {"kernel_backend": "torch", "dtype": "bfloat16"}),
    "gptq-exact": (QUANT / "gptq-4bit-g64-actorder-sym", {"kernel_backend": "torch", "cpu_quant_compute": "exact"}),
}
KV_AND_ADAPTERS = {"k_cache", "v_cache", "k_scale", "v_scale", "adapters"}


def held_tensors(value, seen: dict) -> list:
    """Every tensor reachable from `value` through lists, tuples, dicts and objects' attributes, modules aside: an
    independent walk, not the one sleep uses."""
    if id(value) in seen or isinstance(value, (torch.nn.Module, type)) or callable(value):
        return []
    seen[id(value)] = value
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in held_tensors(v, seen)]
    items = value.items() if isinstance(value, dict) else vars(value).items() if hasattr(value, "__dict__") else ()
    return [t for k, v in items if k not in KV_AND_ADAPTERS for t in held_tensors(v, seen)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_weight_layout_sleeps_and_wakes(checkpoints, layout):
    path, kwargs = LAYOUTS[layout]
    llm = LLM(str(checkpoints[0] if path == "tiny" else path), **ENGINE, **kwargs)
    runner = llm.llm_engine.model_runner
    native = runner.cpu_decoder is not None
    assert native == (layout == "awq-int8-native")
    want = greedy(llm)
    for level in (2, 1):
        llm.sleep(level)
        seen = {}
        held = [t for m in runner.model.modules() for t in held_tensors(dict(vars(m)), seen) if t.numel()]
        assert bool(held) == (level == 1)  # level 2 dropped every weight, whatever holds it
        llm.wake_up()
        assert (runner.cpu_decoder is not None) == native
        assert greedy(llm) == want
    llm.shutdown()


def test_lora_adapters_are_kept(checkpoints, tmp_path):
    """An adapter loaded before a reload (or a level-2 sleep) applies to the new base as to a fresh engine's."""
    tiny, other, _ = checkpoints
    adapter = make_adapter(tiny, tmp_path / "qv", seed=3, r=8, target_modules=["q_proj", "v_proj"])
    lora = LoRARequest("qv", 1, str(adapter))

    def run(llm: LLM) -> list:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora)]

    kwargs = dict(enable_lora=True, max_loras=1, max_lora_rank=8, **ENGINE)
    fresh = LLM(str(other), **kwargs)
    want = run(fresh)
    fresh.shutdown()
    llm = LLM(str(tiny), **kwargs)
    run(llm)
    llm.update_weights(str(other))
    assert run(llm) == want
    llm.sleep(2)
    llm.wake_up()
    assert run(llm) == want
    llm.shutdown()


def test_a_failed_load_restores_the_old_weights(checkpoints, references, monkeypatch):
    llm = LLM(str(checkpoints[0]), **ENGINE)
    runner = llm.llm_engine.model_runner
    build = runner.build_model

    def unreadable(path):
        if path == str(checkpoints[1]):
            raise OSError("disk gone")
        return build(path)

    monkeypatch.setattr(runner, "build_model", unreadable)
    with pytest.raises(OSError, match="disk gone"):
        llm.update_weights(str(checkpoints[1]))
    assert greedy(llm) == references[0]
    llm.shutdown()


def test_update_weights(checkpoints, references):
    tiny, other, wide = checkpoints
    llm = LLM(str(tiny), enable_prefix_caching=True, **ENGINE)
    assert greedy(llm) == references[0]
    llm.update_weights(str(other))
    assert greedy(llm) == references[1]  # the prefix cache held tiny's KV of these prompts: emptied
    with pytest.raises(ValueError, match="does not match the served model: intermediate_size: 256, served 128"):
        llm.update_weights(str(wide))
    with pytest.raises(ValueError, match="cannot read the checkpoint at /nonexistent"):
        llm.update_weights("/nonexistent")
    assert greedy(llm) == references[1]  # refused: the weights serve on
    llm.sleep(2)
    llm.wake_up()  # reads the checkpoint it serves now, not the first one
    assert greedy(llm) == references[1]
    llm.llm_engine.add_request("busy", PROMPTS[0], GREEDY)
    with pytest.raises(EngineBusy, match="update_weights needs an idle engine: 1 request is in flight"):
        llm.update_weights(str(tiny))
    with pytest.raises(EngineBusy, match="sleep needs an idle engine"):
        llm.sleep(1)
    llm.llm_engine.update_weights(str(tiny), abort_in_flight=True)
    assert greedy(llm) == references[0]
    llm.shutdown()


def test_update_weights_from_gguf(checkpoints, tmp_path):
    """GGUF files: another of the same tensor types loads as a fresh engine on it; one of other types is refused,
    naming a tensor and its type. (The tokenizer is the HF checkpoint's: the weights are what is compared.)"""
    tiny, other, _ = checkpoints
    served = write_gguf(tiny, tmp_path / "tiny.gguf", QType.Q8_0)
    same = write_gguf(other, tmp_path / "other.gguf", QType.Q8_0)
    retyped = write_gguf(other, tmp_path / "q4.gguf", QType.Q4_0)
    fresh = LLM(str(same), tokenizer=str(tiny), **ENGINE)
    want = greedy(fresh)
    fresh.shutdown()
    llm = LLM(str(served), tokenizer=str(tiny), **ENGINE)
    first = greedy(llm)
    named = r"blk\.0\.attn_k\.weight: \(\(32, 64\), 'Q4_0'\), served \(\(32, 64\), 'Q8_0'\)"
    with pytest.raises(ValueError, match=named):
        llm.update_weights(str(retyped))
    assert greedy(llm) == first
    llm.update_weights(str(same))
    assert greedy(llm) == want != first
    llm.shutdown()


@pytest.mark.slow
@pytest.mark.subprocess
def test_tensor_parallel(checkpoints, references):
    llm = LLM(str(checkpoints[0]), tensor_parallel_size=2, **ENGINE)
    for level in (1, 2):
        llm.sleep(level)
        llm.wake_up()
        assert greedy(llm) == references[0]
    llm.update_weights(str(checkpoints[1]))
    assert greedy(llm) == references[1]
    with pytest.raises(ValueError, match="does not match"):
        llm.update_weights(str(checkpoints[2]))
    assert greedy(llm) == references[1]
    llm.shutdown()


async def _collect(engine: AsyncLLMEngine, prompt: str, params: SamplingParams = GREEDY):
    outs = [out async for out in engine.generate(prompt, params)]
    return outs[-1].outputs[0]


def test_served_engine(checkpoints, references):
    """Sleep waits for the request in flight; requests while asleep get EngineAsleep, or wait for the wake;
    update_weights finishes or aborts those in flight; an idle engine sleeps by itself and the next request wakes it."""

    async def main():
        engine = AsyncLLMEngine.from_engine_args(str(checkpoints[0]), idle_sleep_seconds=0.5, **ENGINE)
        try:
            long = asyncio.create_task(_collect(engine, PROMPTS[0], SamplingParams(max_tokens=40, ignore_eos=True)))
            await asyncio.sleep(0.05)
            await engine.sleep(1)
            assert long.done() and len(long.result().token_ids) == 40 and engine.is_sleeping()
            with pytest.raises(EngineAsleep, match="not woken within asleep_request_wait=0 s"):
                await _collect(engine, PROMPTS[1])
            engine.engine.config.asleep_request_wait = 30
            waiting = asyncio.create_task(_collect(engine, PROMPTS[1]))
            await asyncio.sleep(0.2)
            assert not waiting.done()
            await engine.wake_up()
            assert (await waiting).token_ids == references[0][1]
            long = asyncio.create_task(_collect(engine, PROMPTS[0], SamplingParams(max_tokens=240, ignore_eos=True)))
            await asyncio.sleep(0.05)
            await engine.update_weights(str(checkpoints[1]), abort_in_flight=True)
            assert long.done() and long.result().finish_reason == "abort"
            assert (await _collect(engine, PROMPTS[2])).token_ids == references[1][2]
            with pytest.raises(ValueError, match="does not match"):
                await engine.update_weights(str(checkpoints[2]))
            deadline = time.monotonic() + 10
            while not engine.is_sleeping():  # idle for idle_sleep_seconds
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            assert engine.engine.sleep_level == 1
            assert (await _collect(engine, PROMPTS[0])).token_ids == references[1][0]  # woke it
            assert not engine.is_sleeping()
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_reset_prefix_cache(checkpoints):
    """A prompt run again hits its cached blocks; after reset_prefix_cache it hits none and answers the same. With a
    request holding blocks the reset is refused (False) and the cache kept; the served engine's waits for the
    request in flight, then empties it."""
    prompt = " ".join(PROMPTS * 6)
    llm = LLM(str(checkpoints[0]), **ENGINE)
    try:
        first, again = (llm.generate(prompt, GREEDY, use_tqdm=False)[0] for _ in range(2))
        assert first.num_cached_tokens == 0 < again.num_cached_tokens
        llm.llm_engine.add_request("holding", PROMPTS[0], GREEDY)
        llm.llm_engine.step()
        assert not llm.reset_prefix_cache()
        llm.llm_engine.abort_request("holding")
        assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens == again.num_cached_tokens
        assert llm.reset_prefix_cache()
        after = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
        assert after.num_cached_tokens == 0 and after.outputs[0].token_ids == first.outputs[0].token_ids
    finally:
        llm.shutdown()

    async def served():
        engine = AsyncLLMEngine.from_engine_args(str(checkpoints[0]), **ENGINE)
        try:
            await _collect(engine, prompt)
            long = asyncio.create_task(_collect(engine, PROMPTS[0], SamplingParams(max_tokens=40, ignore_eos=True)))
            await asyncio.sleep(0.05)
            assert await engine.reset_prefix_cache() and long.done()
            outs = [out async for out in engine.generate(prompt, GREEDY)]
            assert outs[-1].num_cached_tokens == 0
        finally:
            engine.shutdown()

    asyncio.run(served())


def test_shutdown_fails_what_waits_for_a_sleep(checkpoints):
    async def main():
        engine = AsyncLLMEngine.from_engine_args(str(checkpoints[0]), **ENGINE)
        long = asyncio.create_task(_collect(engine, PROMPTS[0], SamplingParams(max_tokens=240, ignore_eos=True)))
        await asyncio.sleep(0.05)
        sleeping = asyncio.create_task(engine.sleep(2))
        await asyncio.sleep(0.05)
        held = asyncio.create_task(_collect(engine, PROMPTS[1]))
        await asyncio.sleep(0.05)
        assert not sleeping.done() and not held.done()  # the sleep waits for the long request, the new one for it
        engine.shutdown()
        for task in (long, sleeping, held):
            with pytest.raises(EngineError, match="shut down"):
                await task

    asyncio.run(main())


RSS_CHILD = """
import json, sys, time, psutil
from tiffin import LLM, SamplingParams
from tiffin.engine.worker.sleep import release_memory
import torch
llm = LLM(sys.argv[1], num_kv_blocks=16)
params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
before = llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0].token_ids
release_memory(torch.device("cpu"))  # what loading freed goes back first: only sleep's release is measured
proc = psutil.Process()
awake = proc.memory_info().rss
llm.sleep(2)
start, freed = time.monotonic(), 0
while time.monotonic() - start < 5 and freed < int(sys.argv[2]):  # within 5 s, as much as the test needs
    freed = max(freed, awake - proc.memory_info().rss)
    time.sleep(0.05)
start = time.monotonic()
llm.wake_up()
wake = time.monotonic() - start
after = llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0].token_ids
print(json.dumps({"freed": freed, "same": before == after, "wake": wake}))
"""


@pytest.mark.slow
@pytest.mark.subprocess
def test_sleep_returns_the_weights_memory(tmp_path):
    """A ~110 MB fp32 checkpoint: sleep(2) gives at least 80% of its bytes back to the OS within 5 s."""
    path = make_tiny_model(tmp_path / "big", hidden_size=512, intermediate_size=1536, num_hidden_layers=8)
    weights = (path / "model.safetensors").stat().st_size
    needed = int(0.8 * weights)
    child = [sys.executable, "-c", RSS_CHILD, str(path), str(needed)]
    out = subprocess.run(child, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["same"]
    assert result["freed"] >= needed, (result, weights)


@pytest.mark.slow
def test_cuda_graphs_and_host_offload(checkpoints, references, cuda_emulation, monkeypatch):
    """On CUDA (emulated): level 1 moves the weights to pinned host memory and frees the KV cache and the graphs;
    the wake and a weight reload capture the graphs again, which then replay on the weights now served (a replay
    reading freed memory raises under the emulation). Greedy tokens as the CPU engine's (`references`)."""
    monkeypatch.setattr(model_runner, "warm_up_triton", lambda runner: None)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    kwargs = dict(device="cuda", dtype="float32", num_kv_blocks=16, max_num_seqs=1, max_model_len=64)

    def run(llm: LLM) -> list[int]:
        replays = cuda_emulation.replays
        out = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].token_ids
        assert cuda_emulation.replays - replays == 3  # every decode step ran from a graph
        return out

    llm = LLM(str(checkpoints[0]), **kwargs)
    assert run(llm) == references[0][0][:4]
    awake = cuda_emulation.allocated()
    llm.sleep(1)
    assert cuda_emulation.allocated() < 0.05 * awake
    assert llm.llm_engine.model_runner.offloaded  # pinned host copies
    llm.wake_up()
    assert cuda_emulation.allocated() == pytest.approx(awake, rel=0.05)
    assert run(llm) == references[0][0][:4]
    llm.update_weights(str(checkpoints[1]))
    assert run(llm) == references[1][0][:4]
    llm.sleep(2)
    assert cuda_emulation.allocated() < 0.05 * awake
    llm.wake_up()
    assert run(llm) == references[1][0][:4]
