"""`tiffin` command line: offline generation, offline batch files (`batch run`, vLLM's `run-batch`), `quantize`
(AutoAWQ / GPTQModel wrappers) and `worker` (a headless node of a multi-node engine).

Errors are one line on stderr: a bad argument exits 2 (argparse's convention). `generate` checks its arguments
before it loads anything, and a model it cannot fetch, read or serve exits 1, without a traceback."""

import argparse
import sys
from pathlib import Path
from typing import NoReturn

from tiffin.cache import default_cache_dir
from tiffin.engine.config import DTYPE_NAMES


class ArgumentParser(argparse.ArgumentParser):
    """argparse's, with its errors on one line (the usage is in --help); its subcommands' parsers are of this
    class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def generate(args: argparse.Namespace) -> None:
    from tiffin.engine.errors import ParamError
    from tiffin.engine.models.source import resolve_model_path
    from tiffin.engine.sampling_params import SamplingParams

    try:
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    except ParamError as e:
        args.parser.error(f"argument --{e.param.replace('_', '-')}: {e}")
    try:
        model = default_tiny_model() if args.model is None else resolve_model_path(args.model)
    except ValueError as e:  # neither a path nor a hub id, or a hub id not cached while offline
        args.parser.error(f"argument --model: {e}")
    except OSError as e:  # the hub cannot be reached or has no such model
        sys.exit(f"{args.parser.prog}: error: {e}")
    from tiffin import LLM

    try:
        outputs = LLM(model, dtype=args.dtype).generate(args.prompts, params, use_tqdm=False)
    except (OSError, ValueError) as e:  # a model tiffin cannot read or serve
        sys.exit(f"{args.parser.prog}: error: {e}")
    for out in outputs:
        print(f"{out.prompt!r} -> {out.outputs[0].text!r}")


def default_tiny_model() -> str:
    """The built-in tiny checkpoint, written under the user's cache folder (never the working directory)."""
    from tiffin.tiny import make_tiny_model

    return str(make_tiny_model(default_cache_dir() / "tiny-llama"))


def batch_run(args: argparse.Namespace) -> None:
    """An OpenAI batch file run offline on one model (tiffin.plugin.openai.run_batch); exits 1 if a line failed."""
    import asyncio

    from tiffin.engine.models.source import resolve_model_path

    try:
        model = default_tiny_model() if args.model is None else resolve_model_path(args.model)
    except ValueError as e:
        args.parser.error(f"argument --model: {e}")
    except OSError as e:
        sys.exit(f"{args.parser.prog}: error: {e}")
    from tiffin import AsyncLLMEngine
    from tiffin.plugin.openai.app import create_app
    from tiffin.plugin.openai.pooling import PoolingServing
    from tiffin.plugin.openai.run_batch import read_lines, run_batch
    from tiffin.plugin.openai.serving import OpenAIServing

    name = args.served_model_name or args.model or "tiffin-tiny-llama"

    async def run() -> int:
        engine = AsyncLLMEngine.from_engine_args(model, dtype=args.dtype)
        try:
            serving = OpenAIServing(engine, name) if engine.task == "generate" else PoolingServing(engine, name)
            app = create_app(serving)
            lines = await asyncio.to_thread(read_lines, app, args.input)
            return await run_batch(app, lines, args.output, args.max_concurrency)
        finally:
            engine.shutdown()

    try:
        failed = asyncio.run(run())
    except (OSError, ValueError) as e:  # an unreadable input, a custom_id used twice, a model tiffin cannot serve
        sys.exit(f"{args.parser.prog}: error: {e}")
    if failed:
        sys.exit(f"{args.parser.prog}: {failed} line(s) failed: see their error in {args.output}")


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


def worker(args: argparse.Namespace) -> None:
    """A headless node of the mp executor's multi-node mode: its ranks, as the engine on node 0 tells them."""
    from tiffin.engine.distributed.multinode import serve_node

    try:
        code = serve_node(args.node_rank, args.nnodes, args.master_addr, args.master_port, args.node_ip_address)
    except (OSError, ValueError) as e:  # rank 0 unreachable, or it refused this node
        sys.exit(f"{args.parser.prog}: error: {e}")
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="tiffin")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate text offline")
    gen.add_argument("prompts", nargs="+")
    gen.add_argument(
        "--model", help="Hugging Face directory, .gguf file or hub id (org/name); default: the built-in tiny model"
    )
    gen.add_argument("--dtype", default="auto", choices=("auto", *DTYPE_NAMES))
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int)
    gen.set_defaults(run=generate, parser=gen)
    batch = commands.add_parser("batch", help="OpenAI batch files offline").add_subparsers(dest="action", required=True)
    run = batch.add_parser("run", help="run an OpenAI batch file (JSONL) on one model, as vLLM's run-batch")
    run.add_argument("input", type=Path, help="the batch file: one {custom_id, method, url, body} per line")
    run.add_argument("-o", "--output", type=Path, required=True, help="where the results go (JSONL, input order)")
    run.add_argument("--model", help="Hugging Face directory, .gguf file or hub id; default: the built-in tiny model")
    run.add_argument("--served-model-name", help="the `model` lines name (default: --model as given)")
    run.add_argument("--dtype", default="auto", choices=("auto", *DTYPE_NAMES))
    run.add_argument("--max-concurrency", type=int, default=32, help="lines running at once")
    run.set_defaults(run=batch_run, parser=run)
    w = commands.add_parser(
        "worker", help="a headless node's tensor/pipeline-parallel ranks (vLLM's --headless), joining the engine's"
    )
    w.add_argument("--nnodes", type=int, required=True, help="nodes in all, as the engine's nnodes")
    w.add_argument("--node-rank", type=int, required=True, help="this node's index, 1..nnodes-1")
    w.add_argument("--master-addr", required=True, help="the engine's node's address (its master_addr)")
    w.add_argument("--master-port", type=int, default=29501, help="the engine's master_port")
    w.add_argument(
        "--node-ip-address", help="this node's address, which its ranks bind (default: its route to --master-addr)"
    )
    w.set_defaults(run=worker, parser=w)
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
