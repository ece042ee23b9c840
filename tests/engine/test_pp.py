"""Pipeline parallelism on CPU with gloo: greedy and seeded-sampling outputs identical to the single-process
engine's (itself checked against transformers, PEFT, gguf-py and the quantizers' dequantization elsewhere) for PP=2,
PP=3 over uneven layers (2 + 2 + 1) and TP=2 x PP=2 (with an int8 KV cache and n-gram speculation), on the tiny
Llama, Qwen2 (as GGUF Q8_0; tied head: the last stage holds the embedding too) and Qwen3 checkpoints and on AWQ and
act-order GPTQ fixtures; with two LoRA adapters in a mixed batch, prefix-cache hits, preemption (recompute, and swap
with the prefix cache's host tier) on a small KV pool. Each stage holds only its layers' weights (the others are not
read) and KV; no worker is left after shutdown (counted); a hung stage fails the engine within distributed_timeout.
One engine per configuration: processes are costly on two cores."""

import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf_files import write_gguf
from lora_adapters import make_adapter

from tiffin import LLM, SamplingParams
from tiffin.engine.distributed import group
from tiffin.engine.distributed.pipeline import PipelineParallel, layer_partition
from tiffin.engine.errors import EngineDeadError
from tiffin.engine.lora.request import LoRARequest
from tiffin.engine.models.gguf_checkpoint import GGUFCheckpoint
from tiffin.engine.models.loader import build_model, get_model_config
from tiffin.tiny import make_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

QUANT = Path(__file__).parents[1] / "fixtures" / "quant"
NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
# per-request seeds, and one request drawing from the engine's own seeded stream (EngineConfig.seed)
SAMPLED = [SamplingParams(temperature=1.0, top_p=0.9, seed=s, max_tokens=NEW_TOKENS, ignore_eos=True) for s in (1, 2)]
SAMPLED.append(SamplingParams(temperature=0.8, max_tokens=NEW_TOKENS, ignore_eos=True))
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def prompts(vocab: int, lens=(1, 7, 23, 41), seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(4, vocab, (n,), generator=g).tolist()} for n in lens]


def run(llm: LLM, vocab: int, **kwargs) -> list[list[int]]:
    """Greedy outputs, then seeded samples, of one batch (the sampled requests run beside greedy ones)."""
    ps = prompts(vocab)
    outs = llm.generate(ps + ps[: len(SAMPLED)], [GREEDY] * len(ps) + SAMPLED, use_tqdm=False, **kwargs)
    return [o.outputs[0].token_ids for o in outs]


class Pair:
    """The single-process engine and the staged one on the same checkpoint and settings."""

    def __init__(self, path, vocab: int, pp: int, tp: int = 1, staged: dict | None = None, **args):
        self.path, self.vocab = str(path), vocab
        self.whole = LLM(self.path, **args)
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        staged = dict(pipeline_parallel_size=pp, tensor_parallel_size=tp, distributed_timeout=60) | (staged or {})
        self.staged = LLM(self.path, **staged, **args)
        new = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
        self.workers = [p for p in new if "spawn_main" in " ".join(p.cmdline())]  # not multiprocessing's tracker
        assert len(self.workers) == pp * tp - 1

    def both(self, fn) -> tuple:
        return fn(self.whole), fn(self.staged)

    def close(self) -> None:
        self.staged.shutdown()
        psutil.wait_procs(self.workers, timeout=10)
        assert not [p for p in self.workers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


# verifying n-gram proposals (of one token: the tiny model repeats few longer ones) across the stages
NGRAM = {"method": "ngram", "prompt_lookup_min": 1, "disable_by_batch_size": None}
# With batches in flight the batches differ from the one-process engine's: the quantized layers' int8 activations
# (from a number of rows on), half-precision GEMMs and an int8 KV cache verifying proposals make a row's numerics
# depend on its batch, enough to change the one-process engine's own tokens with max_num_batched_tokens. Those run
# float32 on the exact kernels, or one batch in flight (the one-process schedule).
EXACT = {"cpu_quant_compute": "exact", "dtype": "float32"}


@pytest.mark.parametrize(
    "arch, layers, pp, tp, fmt, extra",
    [
        ("qwen2", 5, 3, 1, "gguf", {"cpu_quant_compute": "exact"}),
        ("qwen3", 3, 2, 2, "hf", {"kv_cache_dtype": "int8", "speculative_config": NGRAM, "one_batch": True}),
    ],
    ids=["qwen2-gguf-pp3-uneven-tied", "qwen3-tp2xpp2-int8-kv-speculating"],
)
def test_outputs_match_one_process(arch, layers, pp, tp, fmt, extra, tmp_path):
    path = make_tiny_model(tmp_path / "hf", arch=arch, num_hidden_layers=layers)
    if fmt == "gguf":
        path = write_gguf(path, tmp_path / "m.gguf", QType.Q8_0)
    extra = dict(extra)
    staged = {"pipeline_batches_in_flight": 1} if extra.pop("one_batch", False) else {}
    pair = Pair(path, get_model_config(path).vocab_size, pp, tp, staged, dtype="float32", num_kv_blocks=12, **extra)
    try:
        expected, got = pair.both(lambda llm: run(llm, pair.vocab))
        stats = pair.staged.llm_engine.stats()
    finally:
        pair.close()
    assert got == expected
    assert stats.num_preemptions > 0 and (stats.spec_draft_tokens > 0 or "speculative_config" not in extra), stats


def serve(engine) -> dict:
    """Step `engine` until its requests finish; each one's last output."""
    final = {}
    while engine.has_unfinished_requests():
        final.update((o.request_id, o) for o in engine.step())
    return final


def count_overlapping_starts(engine, monkeypatch) -> list[int]:
    """Each batch the staged engine starts from now on appends how many others were in flight then."""
    counts, runner = [], engine.model_runner
    start = runner.start_step
    monkeypatch.setattr(runner, "start_step", lambda out: counts.append(len(engine.batches.batches)) or start(out))
    return counts


class TestLlamaPP2:
    """One engine for these (its process group must end before another engine's starts)."""

    @pytest.fixture(scope="class")
    def llama_pp2(self, tmp_path_factory):
        """Three layers over two stages (2 + 1), adapters on, a pool of 10 blocks that preempts by swap, the prefix
        cache's host tier, chunked prefills."""
        path = make_tiny_model(tmp_path_factory.mktemp("llama3l"), arch="llama", num_hidden_layers=3)
        args = dict(dtype="float32", enable_lora=True, max_loras=2, num_kv_blocks=10, max_num_batched_tokens=37)
        args |= dict(preemption_mode="swap", swap_space=0.001, kv_offload_memory=1 << 20)
        pair = Pair(path, get_model_config(path).vocab_size, 2, **args)
        yield pair
        pair.close()

    def test_swapped_and_prefix_hits_match(self, llama_pp2, monkeypatch):
        """Each stage copies its layers' KV to and from its host blocks (the stages agree on their counts). The batch
        runs twice, a prompt filling the pool between: the second time its prefixes come back from the host tier.
        Two batches in flight meanwhile: counted, each start of a batch while another has not returned."""
        pair, filler = llama_pp2, {"prompt_token_ids": list(range(100, 250))}
        overlapping = count_overlapping_starts(pair.staged.llm_engine, monkeypatch)

        def twice(llm: LLM) -> list:
            first = run(llm, pair.vocab)
            llm.generate(filler, SamplingParams(max_tokens=1), use_tqdm=False)
            return [first, run(llm, pair.vocab)]

        expected, got = pair.both(twice)
        assert got == expected
        stats = pair.staged.llm_engine.stats()
        assert stats.swapped_out_seqs > 0 and stats.host_tier_hits > 0, stats
        assert overlapping and max(overlapping) == 1  # never more than pipeline_parallel_size in flight

    def test_stage_0_starts_the_next_batch_while_stage_1_holds_one(self, llama_pp2, monkeypatch):
        """The worker (stage 1) stopped: rank 0 still runs its stage on a second batch, of other requests, then
        waits for the first's logits; resumed, every request's tokens are the one-process engine's."""
        pair = llama_pp2
        engine, worker = pair.staged.llm_engine, psutil.Process(pair.workers[0].pid)
        # prompts no earlier test cached: more tokens than a step takes (max_num_batched_tokens 37)
        ps, params = prompts(pair.vocab, (7, 23, 41, 30, 9, 13), seed=1), [GREEDY] * 4 + SAMPLED[:2]
        started, start = [], engine.model_runner.start_step  # each batch once stage 0 ran it
        monkeypatch.setattr(engine.model_runner, "start_step", lambda out: (start(out), started.append(out.seqs))[0])
        for i, (prompt, p) in enumerate(zip(ps, params)):
            engine.add_request(str(i), prompt, p)
        final = {}
        worker.suspend()
        try:
            thread = threading.Thread(target=lambda: final.update(serve(engine)))
            thread.start()
            deadline = time.monotonic() + 30
            while len(started) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)  # room for a wrong third start
            assert len(started) == 2 and not set(started[0]) & set(started[1])
        finally:
            worker.resume()
        thread.join(60)
        expected = [o.outputs[0].token_ids for o in pair.whole.generate(ps, params, use_tqdm=False)]
        assert [final[str(i)].outputs[0].token_ids for i in range(len(ps))] == expected
        assert not engine.scheduler.in_flight and not engine.batches.batches

    def test_a_failing_request_and_an_abort_in_flight_touch_no_other(self, llama_pp2, monkeypatch):
        """Sampling raises for one request: the batches in flight finish, then its batch runs again by halves
        until it fails alone; another request is aborted while its batch is in flight. The rest are the
        one-process engine's tokens, and every block comes back."""
        pair = llama_pp2
        engine = pair.staged.llm_engine
        ps, params = prompts(pair.vocab, (19, 33, 8, 27, 14, 21), seed=2), [GREEDY] * 6
        sampler = engine.model_runner.sampler
        sample = type(sampler).__call__

        def failing(self, logits, rows, *args):
            bad = self is sampler and any(r.request_id == "bad" for r in rows)
            if bad and engine.scheduler.num_generated_tokens > 20:  # some steps in
                raise RuntimeError("sampler failed")
            return sample(self, logits, rows, *args)

        monkeypatch.setattr(type(sampler), "__call__", failing)
        ids = ["0", "bad", "2", "3", "4", "5"]
        for rid, prompt, p in zip(ids, ps, params):
            engine.add_request(rid, prompt, p)
        engine.step()  # the first batch in flight
        aborted = next(s.request_id for s in engine.scheduler.in_flight if s.request_id != "bad")
        (abort,) = engine.abort_request(aborted)
        final = serve(engine)
        expected = [o.outputs[0].token_ids for o in pair.whole.generate(ps, params, use_tqdm=False)]
        assert final["bad"].error == "RuntimeError: sampler failed"
        assert abort.finished and abort.outputs[0].finish_reason == "abort" and aborted not in final
        rest = [i for i, rid in enumerate(ids) if rid not in ("bad", aborted)]
        assert [final[ids[i]].outputs[0].token_ids for i in rest] == [expected[i] for i in rest]
        assert engine.stats().kv_blocks_used == 0 and not engine.scheduler.in_flight

    def test_lora_mixed_batch_matches(self, llama_pp2, tmp_path):
        """Each stage fills its layers' slices of the adapters rank 0 installs."""
        pair = llama_pp2
        adapter = dict(r=8, lora_alpha=16, target_modules=TARGETS)
        dirs = [make_adapter(pair.path, tmp_path / f"a{i}", seed=i, **adapter) for i in (1, 2)]
        loras = [None, LoRARequest("a1", 1, str(dirs[0])), LoRARequest("a2", 2, str(dirs[1])), None]
        loras += loras[1:4]  # the sampled requests run with adapters too
        expected, got = pair.both(lambda llm: run(llm, pair.vocab, lora_request=loras))
        assert got == expected
        assert expected[1] != run(pair.whole, pair.vocab)[1]  # the adapters change the outputs

    def test_stages_hold_their_layers_and_kv(self, llama_pp2):
        """Rank 0 (stage 0 of 3 layers split 2 + 1): layers 0-1, the embedding, no norm or head; its KV pool two
        layers deep."""
        runner = llama_pp2.staged.llm_engine.model_runner
        names = {n for n, _ in runner.model.named_parameters()}
        assert any(n.startswith("model.layers.1.") for n in names) and not any("layers.2." in n for n in names)
        assert "model.embed_tokens.weight" in names and not {"lm_head.weight", "model.norm.weight"} & names
        assert runner.kv_cache.shape[1] == 2
        # its adapter slots cover its layers; adapters are checked against every stage's
        assert {n.split(".")[2] for n in runner.lora_slots.layers if ".layers." in n} == {"0", "1"}
        assert any(".layers.2." in n for n in runner.lora_slots.check_layers)


@pytest.mark.parametrize("name", ["awq-g64", "gptq-4bit-g128-actorder-asym-v2"])
def test_quantized_matches_one_process(name):
    pair = Pair(QUANT / name, 512, 2, kernel_backend="torch", **EXACT)
    try:
        expected, got = pair.both(lambda llm: run(llm, 512))
    finally:
        pair.close()
    assert got == expected


def test_hung_last_stage_fails_within_the_timeout(tiny_model):
    """Rank 0 waits for the last stage's logits (a point-to-point receive): bounded by distributed_timeout too, the
    error naming the ranks; shutdown leaves no process."""
    llm = LLM(tiny_model("llama"), pipeline_parallel_size=2, distributed_timeout=3)
    worker = llm.llm_engine.model_runner.group.procs[0]
    try:
        llm.generate([[5, 6]], GREEDY, use_tqdm=False)
        os.kill(worker.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"pipeline-parallel rank\(s\) 1 did not answer within"):
            llm.generate([[5, 6]], GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 3 + group.DEATH_GRACE + 4 and llm.llm_engine.failure() is not None
    finally:
        llm.shutdown()
    assert not worker.is_alive()


def test_last_stage_reads_only_its_weights(tiny_model, monkeypatch):
    """Stage 1 of 2 of the tied Qwen2: layer 1, the norm and the embedding the head is tied to, as the whole model
    holds them; the other layer's tensors are never read."""
    monkeypatch.setenv("TIFFIN_CPU_FP32_GEMM", "mkl")  # plain weights kept, not prepacked for oneDNN
    path = tiny_model("qwen2")
    config = get_model_config(path)
    whole = dict(build_model(config, path, torch.device("cpu"), 64, "torch").named_parameters())
    read = []
    safe_open = __import__("safetensors").safe_open

    class Spy:
        def __init__(self, *args, **kwargs):
            self.f = safe_open(*args, **kwargs)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, key):
            read.append(key)
            return self.inner.get_slice(key)

    monkeypatch.setattr("tiffin.engine.models.loader.safe_open", Spy)
    stage = build_model(config, path, torch.device("cpu"), 64, "torch", pp=PipelineParallel(1, 2))
    params = dict(stage.named_parameters())
    assert sorted(params) == sorted(n for n in whole if not n.startswith("model.layers.0."))
    assert all(torch.equal(t, whole[n]) for n, t in params.items())
    assert read and not [k for k in read if k.startswith("model.layers.0.")]


def test_gguf_stage_reads_only_its_tensors(tiny_model, tmp_path, monkeypatch):
    """Stage 0 of 2 of a GGUF file: its tensors alone are read (a skipped one is never dequantized)."""
    path = write_gguf(tiny_model("llama"), tmp_path / "m.gguf", QType.Q8_0)
    read, tensor = [], GGUFCheckpoint._tensor

    def spy(self, t, kept):
        read.append(self.hf_names[t.name])
        return tensor(self, t, kept)

    monkeypatch.setattr(GGUFCheckpoint, "_tensor", spy)
    stage = build_model(get_model_config(path), path, torch.device("cpu"), 64, "torch", pp=PipelineParallel(0, 2))
    assert "model.embed_tokens.weight" in read and "model.layers.0.mlp.down_proj.weight" in read
    assert not [n for n in read if n.startswith(("model.layers.1.", "model.norm.", "lm_head."))]
    assert not any(n.startswith("model.layers.1.") for n, _ in stage.named_parameters())


def test_layer_partition():
    assert layer_partition(5, 3) == [2, 2, 1] and layer_partition(3, 2) == [2, 1] and layer_partition(4, 2) == [2, 2]
    assert layer_partition(7, 4) == [2, 2, 2, 1] and layer_partition(5, 3, "1,1,3") == [1, 1, 3]
    with pytest.raises(ValueError, match="must give 2 stage"):
        layer_partition(5, 2, "1,1,3")
    with pytest.raises(ValueError, match="leaves a stage without layers: the model has 2"):
        layer_partition(2, 3)


@pytest.mark.parametrize(
    "args, error",
    [
        (dict(pipeline_parallel_size=3), "leaves a stage without layers"),
        (dict(pipeline_parallel_size=2, pipeline_layer_partition="2,1"), "must give 2 stage"),
        (dict(pipeline_parallel_size=2, speculative_config="draft"), "speculative decoding with a draft model"),
        (dict(pipeline_parallel_size=2, task="embed"), "not task 'embed'"),
        (dict(pipeline_parallel_size=0), "pipeline_parallel_size must be >= 1"),
    ],
)
def test_refusals_name_the_setting(tiny_model, args, error):
    if args.get("speculative_config") == "draft":
        args = args | {"speculative_config": {"method": "draft_model", "model": tiny_model("llama")}}
    before = psutil.Process().children(recursive=True)
    with pytest.raises(ValueError, match=error):
        LLM(tiny_model("llama"), **args)
    assert psutil.Process().children(recursive=True) == before  # refused before any worker started


def test_partition_override_gives_each_stage_its_layers():
    stages = [PipelineParallel(i, 3, partition="1,1,3").layers(5) for i in range(3)]
    assert stages == [range(0, 1), range(1, 2), range(2, 5)]


def test_bento_settings_pass_through(monkeypatch):
    from tiffin.plugin.service import Settings

    monkeypatch.setenv("TIFFIN_PIPELINE_LAYER_PARTITION", "2,1")
    kwargs = Settings(pipeline_parallel_size=2, tensor_parallel_size=2).engine_kwargs()
    assert kwargs["pipeline_parallel_size"] == 2 and kwargs["tensor_parallel_size"] == 2
    assert kwargs["pipeline_layer_partition"] == "2,1"
