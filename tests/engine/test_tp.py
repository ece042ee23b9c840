"""Tensor parallelism on CPU with gloo, TP=2: greedy and seeded-sampling outputs identical to TP=1 (itself checked
against transformers, PEFT and the quantizers' own dequantization by test_engine_parity, test_lora and
test_quant_fixtures) on the four tiny architectures (Qwen2 with one KV head: replicated KV), on AWQ and act-order
GPTQ fixtures, with LoRA adapters in a mixed batch; named refusals; a killed or hung worker fails the engine,
naming its rank, within the collective timeout, and leaves no process behind."""

import asyncio
import dataclasses
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch
from lora_adapters import make_adapter

from tiffin import LLM, SamplingParams
from tiffin.engine.async_llm_engine import AsyncLLMEngine
from tiffin.engine.distributed import group
from tiffin.engine.distributed.tensor_parallel import TensorParallel
from tiffin.engine.errors import EngineDeadError, EngineError
from tiffin.engine.lora.request import LoRARequest
from tiffin.engine.models.loader import build_model, get_model_config
from tiffin.engine.outputs import EngineStats
from tiffin.engine.worker import model_runner
from tiffin.kernels import triton_common as tc
from tiffin.tiny import make_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

QUANT = Path(__file__).parents[1] / "fixtures" / "quant"
PROMPT_LENS = (1, 7, 23, 41)
NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
TP2 = (TensorParallel(), TensorParallel(0, 2), TensorParallel(1, 2))
# per-request seeds, and one request drawing from the engine's own seeded stream (EngineConfig.seed)
SAMPLED = [SamplingParams(temperature=1.0, top_p=0.9, seed=s, max_tokens=NEW_TOKENS, ignore_eos=True) for s in (1, 2)]
SAMPLED.append(SamplingParams(temperature=0.8, max_tokens=NEW_TOKENS, ignore_eos=True))


def prompts(vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"prompt_token_ids": torch.randint(4, vocab, (n,), generator=g).tolist()} for n in PROMPT_LENS]


def run(llm: LLM, vocab: int, max_tokens: int = NEW_TOKENS, **kwargs) -> list[list[int]]:
    """Greedy outputs, then seeded samples, of one batch (the sampled requests run beside greedy ones)."""
    ps = prompts(vocab)
    params = [dataclasses.replace(p, max_tokens=max_tokens) for p in [GREEDY] * len(ps) + SAMPLED]
    outs = llm.generate(ps + ps[: len(SAMPLED)], params, use_tqdm=False, **kwargs)
    return [o.outputs[0].token_ids for o in outs]


def tp_workers(llm: LLM) -> list:
    return llm.llm_engine.model_runner.group.procs


def both(path, vocab: int, **engine_args) -> EngineStats:
    """The same batch at TP=1 and TP=2 gives the same tokens; after shutdown, no worker is left. Returns the TP=2
    engine's stats."""
    expected = run(LLM(str(path), dtype="float32", **engine_args), vocab)
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=2, distributed_timeout=30, **engine_args)
    try:
        got, stats = run(llm, vocab), llm.llm_engine.stats()
    finally:
        workers = tp_workers(llm)
        llm.shutdown()
    assert workers and not any(p.is_alive() for p in workers)
    assert got == expected
    return stats


@pytest.mark.parametrize(
    "arch, overrides, engine_args",
    [
        ("llama", {}, {"num_kv_blocks": 10, "max_num_batched_tokens": 37}),  # preemption, chunked prefill
        ("mistral", {}, {}),
        ("qwen2", {"num_key_value_heads": 1}, {}),
        ("qwen3", {}, {}),
        # verifying n-gram proposals (of one token: the tiny model repeats few longer ones) on both ranks
        (
            "qwen3",
            {},
            {"speculative_config": {"method": "ngram", "prompt_lookup_min": 1, "disable_by_batch_size": None}},
        ),
    ],
    ids=["llama-preempted-chunked", "mistral", "qwen2-mqa", "qwen3", "qwen3-speculating"],
)
def test_outputs_match_tp1(arch, overrides, engine_args, tmp_path):
    path = make_tiny_model(tmp_path, arch=arch, **overrides)
    stats = both(path, get_model_config(path).vocab_size, **engine_args)
    if "speculative_config" in engine_args:
        assert stats.spec_draft_tokens > 0, stats
    else:
        assert stats.num_preemptions > 0 or not engine_args


@pytest.mark.parametrize("kv_offload_dtype", ["auto", "int8"])
def test_host_tiers_match_tp1(tiny_model, kv_offload_dtype):
    """Preemption by swap and the prefix cache's host tier: every rank copies its share of the KV (an int8 tier's
    scales are per KV head: each rank quantizes its heads as one rank does). The batch runs twice, a prompt
    filling the pool between: the second time its prefixes come back from the tier (lossless in auto)."""
    path, args = str(tiny_model("llama")), dict(dtype="float32", num_kv_blocks=10, preemption_mode="swap")
    args |= dict(swap_space=0.001, kv_offload_memory=1 << 20, kv_offload_dtype=kv_offload_dtype)
    filler = {"prompt_token_ids": list(range(100, 250))}

    def twice(llm: LLM) -> list:
        first = run(llm, 2048)
        llm.generate(filler, SamplingParams(max_tokens=1), use_tqdm=False)
        return [first, run(llm, 2048)]

    expected = twice(LLM(path, **args))
    llm = LLM(path, tensor_parallel_size=2, distributed_timeout=30, **args)
    try:
        got, stats = twice(llm), llm.llm_engine.stats()
    finally:
        llm.shutdown()
    assert got == expected
    # the last draws from the engine's stream
    assert expected[0][:-1] == expected[1][:-1] or kv_offload_dtype == "int8"
    assert stats.swapped_out_seqs > 0 and stats.host_tier_hits > 0, stats


@pytest.mark.parametrize("name", ["awq-g64", "gptq-4bit-g128-actorder-asym-v2"])
def test_quantized_outputs_match_tp1(name):
    """act-order g128: each rank's 64 rows of o_proj hold parts of groups, padded to whole ones. On the exact path:
    the native kernels quantize activations a block at a time (15 bits), and a row-parallel layer's partial sums,
    added in another order, move codes of the next layer's input: logprobs 1e-4 from TP=1's (awq-g64 on the AVX2
    EPYC, its portable and AVX2 tiles alike), enough to part a sampled token from TP=1's now and then."""
    both(QUANT / name, 512, kernel_backend="torch", cpu_quant_compute="exact")


def test_lora_mixed_batch_matches_tp1(tiny_model, tmp_path):
    base = tiny_model("llama")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    dirs = [make_adapter(base, tmp_path / f"a{i}", seed=i, r=8, lora_alpha=16, target_modules=targets) for i in (1, 2)]
    loras = [None, LoRARequest("a1", 1, str(dirs[0])), LoRARequest("a2", 2, str(dirs[1])), None]
    loras += loras[1:4]  # the sampled requests run with adapters too
    vocab = get_model_config(base).vocab_size
    expected = run(LLM(base, dtype="float32", enable_lora=True), vocab, lora_request=loras)
    llm = LLM(base, dtype="float32", enable_lora=True, tensor_parallel_size=2)
    try:
        assert run(llm, vocab, lora_request=loras) == expected
        assert expected[1] != run(llm, vocab)[1]  # the adapters change the outputs
    finally:
        llm.shutdown()


def test_refusals_name_the_shape(tiny_model):
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by tensor_parallel_size 3"):
        LLM(tiny_model("llama"), tensor_parallel_size=3)
    config = get_model_config(QUANT / "awq-g64")  # o_proj: 128 inputs, 32 per rank of 4: not whole groups of 64
    with pytest.raises(ValueError, match=r"group size 64 does not divide .* 32 per rank \(tensor_parallel_size 4\)"):
        build_model(config, QUANT / "awq-g64", torch.device("cpu"), 64, "torch", TensorParallel(0, 4))


def test_shards_are_slices_of_the_checkpoint(tiny_model, monkeypatch):
    """Rank 1 of 2 of the one-KV-head model: the second half of q and of the vocabulary, the one KV head whole,
    the second half of o_proj's inputs."""
    monkeypatch.setenv("TIFFIN_CPU_FP32_GEMM", "mkl")  # plain weights kept, not prepacked for oneDNN
    path = make_tiny_model(Path(tiny_model("llama")).parent / "mqa", arch="qwen2", num_key_value_heads=1)
    config = get_model_config(path)
    whole = build_model(config, path, torch.device("cpu"), 64, "torch")
    shard = build_model(config, path, torch.device("cpu"), 64, "torch", TensorParallel(1, 2))
    attn, attn1 = whole.model.layers[0].self_attn, shard.model.layers[0].self_attn
    q, k, v = attn.qkv_proj.weight.split(attn.qkv_proj.output_sizes)
    q1, k1, v1 = attn1.qkv_proj.weight.split(attn1.qkv_proj.output_sizes)
    assert torch.equal(q1, q.chunk(2)[1]) and torch.equal(k1, k) and torch.equal(v1, v)
    assert torch.equal(attn1.o_proj.weight, attn.o_proj.weight.chunk(2, dim=1)[1])
    assert torch.equal(shard.model.embed_tokens.weight, whole.model.embed_tokens.weight.chunk(2)[1])


@pytest.mark.parametrize("name", sorted(p.name for p in QUANT.iterdir() if p.is_dir()))
def test_quantized_shards_compute_the_whole_layer(name):
    assert_shards_compute_the_whole_layer(QUANT / name)


def assert_shards_compute_the_whole_layer(path: Path) -> None:
    """A quantized checkpoint's layers, built as ranks 0 and 1 of 2 in this process: a column-parallel layer's shards
    give their slices of each stacked output, a row-parallel layer's partial outputs sum to the whole one's."""
    config = get_model_config(path)
    config.dtype = torch.float32
    whole, *ranks = (build_model(config, path, torch.device("cpu"), 64, "torch", tp) for tp in TP2)
    x = torch.randn(3, config.intermediate_size, generator=torch.Generator().manual_seed(0))
    layers = [m.model.layers[1] for m in (whole, *ranks)]
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        full, *shards = (layer.get_submodule(name) for layer in layers)
        expected = full.method.apply(full, x[:, : full.input_size])
        if shards[0].split == "row":
            inputs = x[:, : full.input_size].chunk(2, dim=1)
            got = sum(s.method.apply(s, part) for s, part in zip(shards, inputs))
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        else:
            for i, piece in enumerate(expected.split(full.output_sizes, dim=1)):
                got = [s.method.apply(s, x[:, : s.input_size]).split(s.output_sizes, dim=1)[i] for s in shards]
                assert torch.equal(torch.cat(got, dim=1), piece), (name, i)


@pytest.mark.parametrize("adapters", [False, True], ids=["base", "lora"])
def test_graphed_tp_decode_equals_eager_tp1(tiny_model, cuda_emulation, monkeypatch, tmp_path, adapters):
    """The CUDA path under tensor parallelism (the CUDA emulation; each worker under one of its own, NCCL's
    collectives run by gloo): every rank warms up and captures its decode graphs, all-reduces inside, and the
    ranks replay them together. Greedy and seeded tokens equal the eager TP=1 engine's, with adapters too (rank 0
    sends their installs with the graphed steps); rank 1 replayed every graph rank 0 did; serving launched no
    Triton variant that start-up (warm-up) did not."""
    path = tiny_model("llama")
    # few tokens, a short context: steps under the interpreter cost by their tokens (warm-up runs LoRA kernels on up
    # to max_num_batched_tokens, attention on up to max_model_len); 4 new tokens a request serve the Triton variants
    # 6 did, and rank 0 replays 5 graphs
    args = dict(device="cuda", dtype="float32", num_kv_blocks=64, max_num_seqs=4, max_model_len=64)
    args |= dict(max_num_batched_tokens=32)
    loras, new_tokens = {}, 4
    if adapters:
        lora = LoRARequest("a1", 1, str(make_adapter(path, tmp_path / "a1", seed=1, r=8, lora_alpha=16)))
        loras = {"lora_request": [None, lora, lora, None, lora, None, lora]}
        args |= dict(enable_lora=True, max_loras=2)
    vocab = get_model_config(path).vocab_size
    with monkeypatch.context() as patched:
        patched.setattr(model_runner, "warm_up_triton", lambda runner: None)
        want = run(LLM(str(path), enforce_eager=True, **args), vocab, new_tokens, **loras)
    with tc.recording_launches() as started:
        llm = LLM(str(path), tensor_parallel_size=2, distributed_timeout=120, **args)
    try:
        assert sorted(llm.llm_engine.model_runner.decode_graphs.graphs) == [1, 2, 4]
        with tc.recording_launches() as served:
            got = run(llm, vocab, new_tokens, **loras)
        replays = cuda_emulation.replays
    finally:
        llm.shutdown()
    assert got == want
    assert replays > 0 and cuda_emulation.worker_replays() == {1: replays}
    assert served and not served - started, sorted(served - started, key=str)[:2]


def test_killed_worker_fails_in_flight_requests(tiny_model):
    """SIGKILL: the in-flight request ends with an error naming the rank, the engine turns unhealthy (the Bento's
    /readyz answers 503), shutdown leaves no process."""
    path = tiny_model("llama")

    async def main() -> None:
        engine = AsyncLLMEngine.from_engine_args(str(path), tensor_parallel_size=2, distributed_timeout=10)
        worker = engine.engine.model_runner.group.procs[0]
        try:
            stream = await engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=900, ignore_eos=True))
            await stream.__anext__()  # running
            os.kill(worker.pid, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(EngineError, match="rank 1 died"):
                async for _ in stream:
                    pass
            assert time.monotonic() - start < 10 and not engine.healthy
        finally:
            engine.shutdown()
        assert not worker.is_alive()

    asyncio.run(main())


def test_worker_killed_while_idle_is_reported_at_once(tiny_model):
    """No step needed: health checks (the Bento's /readyz, /livez) see it, the next request fails with it."""
    llm = LLM(tiny_model("llama"), tensor_parallel_size=2)
    worker = tp_workers(llm)[0]
    try:
        os.kill(worker.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while llm.llm_engine.failure() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert llm.llm_engine.failure() == "tensor-parallel worker rank 1 died (exit code -9)"
        with pytest.raises(EngineDeadError, match="rank 1 died"):
            llm.generate([[5, 6]], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()


def test_hung_worker_fails_within_the_timeout(tiny_model):
    llm = LLM(tiny_model("llama"), tensor_parallel_size=2, distributed_timeout=3)
    worker = tp_workers(llm)[0]
    try:
        llm.generate([[5, 6]], GREEDY, use_tqdm=False)
        os.kill(worker.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"rank\(s\) 1 did not answer within distributed_timeout=3s"):
            llm.generate([[5, 6]], GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 3 + group.DEATH_GRACE + 4
    finally:
        llm.shutdown()
    assert not worker.is_alive()


def test_bento_serves_tp2_like_tp1(tiny_model, bento_server):
    """`bentoml serve` with tensor_parallel_size=2 answers the OpenAI API as TP=1 does, and shuts its worker down."""
    prompt = "def main():"
    expected = LLM(tiny_model("llama")).generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].text
    args = {"model": "tiffin-tiny-llama", "tensor_parallel_size": 2, "device": "cpu", "shutdown_grace_period": 1}
    srv = bento_server(args=args)
    body = {"model": "tiffin-tiny-llama", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
    answer = srv.http.post("/v1/completions", json=body | {"ignore_eos": True}, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == expected
    family = psutil.Process(srv.proc.pid).children(recursive=True)
    workers = [p for p in family if "spawn_main" in " ".join(p.cmdline())]
    assert len(workers) == 1
    srv.proc.send_signal(signal.SIGTERM)  # the server's own shutdown must end the rank-1 worker
    srv.proc.wait(30)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in workers)
