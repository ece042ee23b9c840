"""The Ray executor's per-step cost against the mp executor's, same tensor-parallel size, one host, CPU (gloo).

Both run the same worker and step protocol; they differ in where the ranks live (spawned processes vs Ray actors of
a local one-node cluster) and in the side channel (a pipe vs TCP with an auth key). A step here is a decode step of
a small batch on a tiny model, so the fixed per-step cost (the doorbell, two broadcasts, the collectives) is most of
it. The executors alternate, `--rounds` times each, and the median step time of each is reported.

    python benchmarks/executor_overhead.py --tp 2 --rounds 3
"""

import argparse  # noqa: I001  (tiffin is imported before torch: it sets torch's OpenMP defaults)
import statistics
import tempfile
import time

from tiffin import LLM, SamplingParams
from tiffin.tiny import make_tiny_model


def step_ms(llm: LLM, batch: int, steps: int) -> float:
    """Mean wall time of a decode step: a batch of one-token prompts, `steps` tokens each (the prefill step is one
    in `steps + 1`, which a longer run dilutes)."""
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + i]} for i in range(batch)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return (time.perf_counter() - start) / (steps + 1) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import ray

    # a cluster of its own: without an address `ray.init` joins the host's latest cluster (another process's test
    # cluster, busy with its own actors), and refuses `num_cpus` there
    ray.init(address="local", num_cpus=args.tp, include_dashboard=False)
    path = str(make_tiny_model(tempfile.mkdtemp(), arch="llama"))
    times = {"mp": [], "ray": []}
    for _ in range(args.rounds):
        for backend in times:
            llm = LLM(path, dtype="float32", tensor_parallel_size=args.tp, distributed_executor_backend=backend)
            try:
                times[backend].append(step_ms(llm, args.batch, args.steps))
            finally:
                llm.shutdown()
    mp, rayed = (statistics.median(times[b]) for b in ("mp", "ray"))
    for backend, runs in times.items():
        print(f"{backend:4s} TP={args.tp}: median {statistics.median(runs):.2f} ms/step  runs {runs}")
    print(f"ray / mp: {rayed / mp:.3f}")
    ray.shutdown()


if __name__ == "__main__":
    main()
