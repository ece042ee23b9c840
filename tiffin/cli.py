"""`tiffin` command line: offline generation and `quantize` (AutoAWQ / GPTQModel wrappers)."""

import argparse
import sys

DEFAULT_TINY = ".tiffin-cache/tiny-llama"


def generate(args: argparse.Namespace) -> None:
    from tiffin import LLM, SamplingParams

    model = args.model
    if model is None:
        from tiffin.tiny import make_tiny_model

        model = make_tiny_model(DEFAULT_TINY)
    llm = LLM(model, dtype=args.dtype)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    for out in llm.generate(args.prompts, params, use_tqdm=False):
        print(f"{out.prompt!r} -> {out.outputs[0].text!r}")


def quantize(args: argparse.Namespace) -> None:
    from tiffin.quant.tools import quantize as run_quantize  # needs the tiffin[quantize] extra

    out = run_quantize(
        args.model,
        args.output,
        args.method,
        args.calib,
        bits=args.bits,
        group_size=args.group_size,
        desc_act=args.desc_act,
        sym=not args.asym,
        checkpoint_format=args.format,
        modules_to_not_convert=args.skip,
        num_samples=args.num_samples,
        seq_len=args.seq_len,
        device=args.device,
    )
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tiffin")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate text offline")
    gen.add_argument("prompts", nargs="+")
    gen.add_argument(
        "--model", help="Hugging Face directory, .gguf file or hub id (org/name); default: the built-in tiny model"
    )
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int)
    gen.set_defaults(run=generate)
    q = commands.add_parser("quantize", help="quantize a local model with AutoAWQ or GPTQModel (tiffin[quantize])")
    q.add_argument("model", help="local Hugging Face model directory")
    q.add_argument("output", help="directory for the quantized checkpoint")
    q.add_argument("--method", choices=("awq", "gptq"), required=True)
    q.add_argument("--calib", required=True, help="local UTF-8 text file of calibration text")
    q.add_argument("--bits", type=int, default=4)
    q.add_argument("--group-size", type=int, default=128, help="-1: one group per output channel (GPTQ)")
    q.add_argument("--desc-act", action="store_true", help="GPTQ act-order")
    q.add_argument("--asym", action="store_true", help="GPTQ asymmetric (zero point per group)")
    q.add_argument("--format", default="gptq", choices=("gptq", "gptq_v2"), help="GPTQ checkpoint_format")
    q.add_argument("--skip", action="append", metavar="MODULE", help="AWQ modules_to_not_convert (repeatable)")
    q.add_argument("--num-samples", type=int, default=128, help="calibration samples")
    q.add_argument("--seq-len", type=int, default=512, help="tokens per calibration sample")
    q.add_argument("--device", help="device to quantize on (default: cuda if available)")
    q.set_defaults(run=quantize)
    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    sys.exit(main())
