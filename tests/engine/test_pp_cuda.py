"""Pipeline parallelism on the CUDA path, run on the CPU through the CUDA emulation (each worker under one of its own;
NCCL's sends and receives run by gloo on the memory behind the devices, Triton kernels under the interpreter):
every stage on its own device warms up, sizes its KV pool by profiling (PP=2; the stages agreeing on one count) and
captures its decode graphs, a later stage's on its input buffer, which the step's receive fills; two batches in
flight. Greedy and seeded tokens equal the single-process engine's for PP=2 (the tiny Llama, a LoRA adapter on some
requests: each stage fills its layers' slices) and TP=2 x PP=2 (the tiny Qwen3), and every stage replayed as many
graphs as rank 0 did."""

import pytest
import torch
from lora_adapters import make_adapter

from tiffin import LLM, SamplingParams
from tiffin.engine.lora.request import LoRARequest
from tiffin.engine.models.loader import get_model_config
from tiffin.engine.worker import model_runner
from tiffin.kernels import triton_common as tc
from tiffin.testing.cuda_emulation import CudaEmulation

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

NEW_TOKENS = 4  # a step costs by its tokens under the interpreter
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
# per-request seeds, and one request drawing from the engine's own seeded stream (EngineConfig.seed)
SAMPLED = [SamplingParams(temperature=1.0, top_p=0.9, seed=s, max_tokens=NEW_TOKENS, ignore_eos=True) for s in (1, 2)]
SAMPLED.append(SamplingParams(temperature=0.8, max_tokens=NEW_TOKENS, ignore_eos=True))
# no num_kv_blocks: each engine sizes its pool by profiling its largest step (under PP every stage at once), which
# max_num_seqs of max_model_len caps at 12 blocks; few tokens a step (warm-up runs up to max_num_batched_tokens)
ARGS = dict(device="cuda", dtype="float32", max_num_seqs=4, max_model_len=48, max_num_batched_tokens=17)


def run(llm: LLM, vocab: int, lora: LoRARequest | None = None) -> list[list[int]]:
    """Greedy outputs, then seeded samples, of one batch (the sampled requests beside greedy ones); `lora` on every
    other request."""
    g = torch.Generator().manual_seed(0)
    ps = [{"prompt_token_ids": torch.randint(4, vocab, (n,), generator=g).tolist()} for n in (1, 7, 23, 11)]
    ps += ps[: len(SAMPLED)]
    loras = [lora if i % 2 else None for i in range(len(ps))]
    outs = llm.generate(ps, [GREEDY] * 4 + SAMPLED, lora_request=loras, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def staged_equals_one_process(path, emulation: CudaEmulation, monkeypatch, lora=None, **parallel) -> None:
    """The staged engine's tokens are the eager single-process engine's; it captured graphs on every rank and each
    replayed as many as rank 0 (itself at least one a decode step); two batches were in flight at once; serving
    launched no Triton variant on rank 0 that its warm-up did not."""
    vocab, lora_args = get_model_config(path).vocab_size, dict(enable_lora=True, max_loras=2) if lora else {}
    with monkeypatch.context() as patched:
        patched.setattr(model_runner, "warm_up_triton", lambda runner: None)
        want = run(LLM(str(path), enforce_eager=True, **lora_args, **ARGS), vocab, lora)
    with tc.recording_launches() as started:
        llm = LLM(str(path), distributed_timeout=120, **parallel, **lora_args, **ARGS)
    engine = llm.llm_engine
    overlapping, start = [], engine.model_runner.start_step
    monkeypatch.setattr(
        engine.model_runner, "start_step", lambda out: overlapping.append(len(engine.batches.batches)) or start(out)
    )
    try:
        runner = engine.model_runner
        assert runner.decode_graphs.buffers.stage_input is None and sorted(runner.decode_graphs.graphs) == [1, 2, 4]
        assert runner.num_blocks == 12 and runner.kv_cache.device == torch.device("cuda", 0)
        replays = emulation.replays
        with tc.recording_launches() as served:
            got = run(llm, vocab, lora)
        replays = emulation.replays - replays
    finally:
        llm.shutdown()
    assert got == want
    ranks = parallel["tensor_parallel_size"] * parallel["pipeline_parallel_size"]
    assert replays >= NEW_TOKENS - 1 and emulation.worker_replays() == dict.fromkeys(range(1, ranks), replays)
    assert max(overlapping) == 1
    assert served and not served - started, sorted(served - started, key=str)[:2]


def test_pp2_graphed_with_an_adapter_equals_one_process(tiny_model, cuda_emulation, monkeypatch, tmp_path):
    path = tiny_model("llama")
    lora = LoRARequest("a1", 1, str(make_adapter(path, tmp_path / "a1", seed=1, r=8, lora_alpha=16)))
    staged_equals_one_process(path, cuda_emulation, monkeypatch, lora, tensor_parallel_size=1, pipeline_parallel_size=2)


def test_tp2_pp2_graphed_equals_one_process(tiny_model, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with CudaEmulation(device_count=4) as emulation:
        staged_equals_one_process(
            tiny_model("qwen3"),
            emulation,
            monkeypatch,
            tensor_parallel_size=2,
            pipeline_parallel_size=2,
            num_kv_blocks=12,  # the count PP=2 profiles: its profiling, 4 ranks' forwards and captures, skipped
        )


def test_a_later_stage_captures_on_its_input_buffer(tiny_model, cuda_emulation):
    """Stage 1's graphs read their `(hidden, residual)` from views of one buffer at its start, which a receive of
    that size fills in place (contiguous), rather than tensors a step allocates (freed before the next replay)."""
    from tiffin.engine.worker.cuda_graphs import DecodeGraphs

    graphs = DecodeGraphs([1, 2, 4], torch.device("cuda", 1), 16, 8, 4, stage_input=(64, torch.float32))
    assert graphs.buffers.stage_input.shape == (2 * 4 * 64,)
    two = graphs.stage_input(2)
    assert two.shape == (2, 2, 64) and two.is_contiguous() and two.device == torch.device("cuda", 1)
    assert two.data_ptr() == graphs.buffers.stage_input.data_ptr()
    seen = []
    graphs.run(2, lambda *args: seen.append(args[4]))  # no graph of size 2 captured: run eagerly on the buffers
    ((hidden, residual),) = seen
    assert hidden.data_ptr() == two.data_ptr() and residual.data_ptr() == two[1].data_ptr()
