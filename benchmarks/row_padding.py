"""What padding steps to row buckets costs (`padded_tokens`, issue #50): one engine, one seeded workload run with
the runner's `pad_rows` on and off in turn, so both halves share the process, its warm-up and the machine's load.
Prints each round's output tokens/s, the padded/unpadded ratio of the medians, the distinct row counts each
mode ran (the oneDNN kernels it keeps) and how many requests got the same tokens both ways (fp32: all; bf16 oneDNN
rounds a row's outputs differently at some row counts, padded or not, which flips near-ties of a random model).

    python benchmarks/row_padding.py [--shape llama-40m] [--dtype float32] [--n 64] [--rounds 3]

fp32 runs through oneDNN here (TIFFIN_CPU_FP32_GEMM=onednn), the path whose memory grew with unpadded steps."""

import argparse
import dataclasses
import os
import statistics
import tempfile
import time

from common import SHAPES, make_model, parse_range, uniform_workload

from tiffin import LLM, SamplingParams
from tiffin.quant.base import UnquantizedLinearMethod


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-40m", choices=SHAPES)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--n", type=int, default=64, help="requests per round")
    parser.add_argument("--prompt-len", type=parse_range, default=(8, 256), metavar="LO:HI")
    parser.add_argument("--output-len", type=parse_range, default=(8, 96), metavar="LO:HI")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    os.environ["TIFFIN_CPU_FP32_GEMM"] = "onednn"
    os.environ["TIFFIN_THREAD_SIZING"] = "0"  # one thread count for every round: the halves compare alike
    path = make_model(tempfile.mkdtemp(), args.shape)
    work = uniform_workload(args.n, args.prompt_len, args.output_len, 32000, seed=0)
    prompts = [{"prompt_token_ids": p} for p in work.prompts]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in work.output_lens]
    llm = LLM(str(path), dtype=args.dtype, max_num_seqs=args.n, enable_prefix_caching=False)
    runner = llm.llm_engine.model_runner
    if not runner.policy.pad_rows:
        raise SystemExit(f"this runner does not pad rows ({runner.policy}): nothing to compare")
    rows, apply = {True: set(), False: set()}, UnquantizedLinearMethod.apply
    rates, tokens = {True: [], False: []}, {}
    for _ in range(args.rounds):
        for pad in (True, False):
            runner.policy = dataclasses.replace(runner.policy, pad_rows=pad)
            seen = rows[pad]
            UnquantizedLinearMethod.apply = lambda m, layer, x, seen=seen: seen.add(len(x)) or apply(m, layer, x)
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            rates[pad].append(work.output_tokens / (time.perf_counter() - start))
            UnquantizedLinearMethod.apply = apply
            tokens.setdefault(pad, [o.outputs[0].token_ids for o in outs])
    print(f"{args.shape} {args.dtype}, {args.n} requests, prompts {args.prompt_len}, outputs {args.output_len}")
    for pad in (True, False):
        print(
            f"  {'padded  ' if pad else 'unpadded'}: output tok/s {', '.join(f'{r:.0f}' for r in rates[pad])}; "
            f"{len(rows[pad])} distinct row counts at the linears"
        )
    ratio = statistics.median(rates[True]) / statistics.median(rates[False])
    same = sum(a == b for a, b in zip(tokens[True], tokens[False]))
    print(f"  padded / unpadded (medians): {ratio:.3f}; requests with the same tokens: {same} of {args.n}")


if __name__ == "__main__":
    main()
