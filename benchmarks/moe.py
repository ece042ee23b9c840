"""Mixture-of-experts decode on CPU: what a token costs a GGUF MoE model against llama.cpp on the same file, and
against a dense model of its active size (the same attention, one MLP as wide as its `top_k` experts together).

Both models are built from random weights by transformers (Qwen3-MoE and Qwen3, `--shape`), written to GGUF by
llama.cpp's own `convert_hf_to_gguf.py` (bf16) and quantized by its `llama-quantize` (`--types`: Q4_0, Q8_0);
the files are cached in `--cache-dir`. Each file: tiffin's batch-1 decode (one request of a 1-token prompt
generating `--decode-tokens`, the native CPU kernels, experts kept in their blocks) and `llama-bench -n` at the same
thread count, rounds alternating between the two, medians reported.

    python benchmarks/moe.py --llama-cpp "$(../shared/bench/setup-llamacpp.sh)/.."
"""

import argparse
import gc
import os
from pathlib import Path

import torch
from common import markdown_table
from quantized import decode_rate, llama_bench, median
from transformers import AutoConfig, AutoModelForCausalLM

from tiffin import LLM
from tiffin.cache import default_cache_dir
from tiffin.testing.llama_cpp import convert_hf_to_gguf, run_peer
from tiffin.tiny import write_tokenizer

# shape -> Qwen3-MoE config; the dense model of its active size has intermediate_size = top_k * moe_intermediate_size
# 1b: 1.00B parameters, 0.21B active a token (Qwen3-MoE's block; 64 experts of 384, 8 a token)
SHAPES = {
    "1b": dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
               num_experts=64, num_experts_per_tok=8, moe_intermediate_size=384, vocab_size=32000),
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, vocab_size=512),
}  # fmt: skip


def hf_checkpoint(path: Path, shape: dict, moe: bool) -> Path:
    if (path / "config.json").exists():
        return path
    fields = dict(shape, max_position_embeddings=4096, tie_word_embeddings=False, norm_topk_prob=True)
    if not moe:
        fields = {k: v for k, v in fields.items() if "expert" not in k and k != "norm_topk_prob"}
        fields["intermediate_size"] = shape["num_experts_per_tok"] * shape["moe_intermediate_size"]
    config = AutoConfig.for_model("qwen3_moe" if moe else "qwen3", **fields)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    write_tokenizer(path, shape["vocab_size"], True, 4096)
    del model
    gc.collect()
    return path


def gguf_files(args: argparse.Namespace, name: str, moe: bool) -> dict[str, Path]:
    """{type: the model's GGUF file of that type}, converted and quantized by llama.cpp where not cached."""
    root = args.cache_dir / f"{args.shape}-{name}"
    files = {qtype: root / f"{qtype}.gguf" for qtype in args.types}
    if all(f.exists() for f in files.values()):
        return files
    hf = hf_checkpoint(root / "hf", SHAPES[args.shape], moe)
    bf16 = root / "bf16.gguf"
    if not bf16.exists():
        convert_hf_to_gguf(args.llama_cpp, hf, "bf16", bf16)
    for qtype, file in files.items():
        if not file.exists():
            run_peer([args.llama_cpp / "build/bin/llama-quantize", bf16, file, qtype])
    return files


def measure(args: argparse.Namespace, file: Path) -> tuple[float, float]:
    """(tiffin's, llama-bench's) median decode tokens a second on `file`."""
    llm = LLM(str(file), max_model_len=args.decode_tokens + 16)
    decode_rate(llm, 8)  # warm: the native library, first-call allocations
    ours, theirs = [], []
    bench = str(args.llama_cpp / "build/bin/llama-bench")
    for _ in range(args.rounds):
        ours.append(decode_rate(llm, args.decode_tokens))
        theirs.append(llama_bench(bench, str(file), args.threads, 0, args.decode_tokens)["decode"])
    del llm
    gc.collect()
    return median(ours), median(theirs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=list(SHAPES), default="1b")
    parser.add_argument("--types", type=lambda s: s.split(","), default=["Q4_0", "Q8_0"])
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--llama-cpp", type=Path, default=Path.home() / ".cache/tiffin-peers/llama.cpp")
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir() / "moe-bench")
    args = parser.parse_args()
    if not (args.llama_cpp / "build/bin/llama-bench").exists():
        parser.error(f"no llama.cpp at {args.llama_cpp} (build/bin/llama-bench, llama-quantize, convert_hf_to_gguf.py)")
    torch.set_num_threads(args.threads)
    models = {"moe": gguf_files(args, "moe", True), "dense": gguf_files(args, "dense", False)}
    rows, rates = [], {}
    for qtype in args.types:
        for name, files in models.items():
            rates[name, qtype] = measure(args, files[qtype])
            ours, theirs = rates[name, qtype]
            rows.append({
                "model": f"{args.shape} {'MoE' if name == 'moe' else 'dense, MoE active size'}",
                "type": qtype,
                "file GiB": f"{files[qtype].stat().st_size / 2**30:.2f}",
                f"tiffin tok/s (tg{args.decode_tokens})": f"{ours:.1f}",
                f"llama-bench tok/s (tg{args.decode_tokens})": f"{theirs:.1f}",
                "tiffin / llama.cpp": f"{ours / theirs:.2f}",
            })  # fmt: skip
        moe, dense = rates["moe", qtype][0], rates["dense", qtype][0]
        print(f"{qtype}: a MoE token costs {dense / moe:.2f}x the dense model's of its active size (tiffin)")
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
