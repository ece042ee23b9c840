"""`tiffin` command line: offline generation (and later subcommands such as `quantize`)."""

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tiffin")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate text offline")
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--model", help="local Hugging Face model directory (default: the built-in tiny model)")
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int)
    gen.set_defaults(run=generate)
    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    sys.exit(main())
