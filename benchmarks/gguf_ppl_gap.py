"""Where a GGUF's perplexity under llama.cpp parts from the model the file holds: llama-perplexity's own token ids
and per-token NLLs (its `--kl-divergence-base` file), against a plain torch Llama on gguf-py's dequantized weights
with llama.cpp's lossy steps switched on one at a time:

- `plain`: fp32, transformers' numerics (equal to transformers on the same ids within 3e-5 nats a token);
- `act`: each matmul's input quantized as ggml's `vec_dot_type` of the weight: Q8_K (a block of 256, `d =
  1/(-127/max)` in fp32, `max` the signed value of largest magnitude) against K-quants, Q8_0 (a block of 32, `d =
  max|x|/127` stored fp16, codes rounded half to even with `127/max|x|`) against Q4_0 / Q5_0 / Q8_0, Q8_1 (Q8_0 and
  the block sum `s = fp16(d * sum(q))` the weight's minimum multiplies) against Q4_1 / Q5_1;
- `act+kv16`: and K (after RoPE) and V rounded to f16, as llama.cpp's flash attention casts them.

    python benchmarks/gguf_ppl_gap.py [--llama-cpp DIR] --text TEXT FILE.gguf [--configs plain,act,act+kv16]

The text: a file (gguf_parity.py's, for one). Per-token differences between two 8-bit runs are large (the rounding
of 8-bit activations flips with any nudge of their inputs): compare perplexities, not tokens.
"""

import argparse
import math
import re
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch
from common import markdown_table, peer_env
from gguf import GGUFReader
from gguf.quants import dequantize

Q8_K_WEIGHTS = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
Q8_0_WEIGHTS = {"Q4_0", "Q5_0", "Q8_0"}
Q8_1_WEIGHTS = {"Q4_1": 20, "Q5_1": 24}  # -> block bytes; the block's fp16 minimum at bytes 2..3


def q8_K(x: torch.Tensor) -> torch.Tensor:
    """x quantized to Q8_K and back (ggml-quants.c's quantize_row_q8_K)."""
    b = x.reshape(*x.shape[:-1], -1, 256)
    top = b.gather(-1, b.abs().argmax(-1, keepdim=True))
    iscale = torch.where(top != 0, -127 / top, 0)
    return (torch.where(top != 0, 1 / iscale, 0) * (iscale * b).round().clamp(max=127)).reshape(x.shape)


def q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x quantized to Q8_0 (ggml-cpu's x86 quantize_row_q8_0) and back; and Q8_1's block sums `s`."""
    b = x.reshape(*x.shape[:-1], -1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    q = (b * torch.where(amax != 0, 127 / amax, 0)).round()
    d = amax / 127
    return (d.half().float() * q).reshape(x.shape), (d * q.sum(-1, keepdim=True)).half().float()[..., 0]


class Reference:
    """SmolLM2-shaped Llama (llama.cpp's adjacent-pair RoPE on the converter's permuted q / k) from a GGUF."""

    def __init__(self, path: Path):
        reader = GGUFReader(path)
        value = lambda key: reader.fields[key].contents()
        self.layers, self.heads = value("llama.block_count"), value("llama.attention.head_count")
        self.kv_heads, self.eps = (
            value("llama.attention.head_count_kv"),
            value("llama.attention.layer_norm_rms_epsilon"),
        )
        self.w, self.types, self.mins = {}, {}, {}
        for t in reader.tensors:
            shape = tuple(int(s) for s in reversed(t.shape.tolist()))
            self.w[t.name] = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), np.float32)).view(shape)
            self.types[t.name] = kind = t.tensor_type.name
            if kind in Q8_1_WEIGHTS:
                raw = np.asarray(t.data).view(np.uint8).reshape(-1, Q8_1_WEIGHTS[kind])[:, 2:4].copy()
                self.mins[t.name] = torch.from_numpy(raw.view(np.float16).astype(np.float32)).view(shape[0], -1)
        self.head_dim = self.w["blk.0.attn_q.weight"].shape[0] // self.heads
        inv = value("llama.rope.freq_base") ** (-torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim)
        angles = torch.arange(8192, dtype=torch.float64)[:, None] * inv
        self.cos, self.sin = angles.cos().float(), angles.sin().float()

    def linear(self, x: torch.Tensor, name: str, act: bool) -> torch.Tensor:
        w, kind = self.w[name], self.types[name]
        if not act or kind == "F32":
            return x @ w.T
        if kind in Q8_K_WEIGHTS:
            return q8_K(x) @ w.T
        xq, sums = q8_0(x)
        if kind in Q8_0_WEIGHTS:
            return xq @ w.T
        if kind in Q8_1_WEIGHTS:  # the minimum times Q8_1's rounded s, not the exact sum of the codes
            return xq @ w.T + (sums - xq.view(*x.shape[:-1], -1, 32).sum(-1)) @ self.mins[name].T
        raise ValueError(f"{name}: no emulation of llama.cpp's activations against {kind}")

    def rope(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin, even, odd = self.cos[: len(x), None], self.sin[: len(x), None], x[..., 0::2], x[..., 1::2]
        return torch.stack([even * cos - odd * sin, even * sin + odd * cos], -1).flatten(-2)

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w[name]

    @torch.inference_mode()
    def logits(self, tokens: list[int], first: int, act: bool, kv16: bool) -> torch.Tensor:
        n, group = len(tokens), self.heads // self.kv_heads
        x, mask = self.w["token_embd.weight"][torch.tensor(tokens)], torch.full((n, n), -math.inf).triu(1)
        for i in range(self.layers):
            lin = lambda h, part, i=i: self.linear(h, f"blk.{i}.{part}.weight", act)
            h = self.norm(x, f"blk.{i}.attn_norm.weight")
            q = self.rope(lin(h, "attn_q").view(n, self.heads, -1))
            k, v = self.rope(lin(h, "attn_k").view(n, self.kv_heads, -1)), lin(h, "attn_v").view(n, self.kv_heads, -1)
            if kv16:
                k, v = k.half().float(), v.half().float()
            scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(group, 1)) / math.sqrt(self.head_dim)
            out = torch.einsum("hqk,khd->qhd", (scores + mask).softmax(-1), v.repeat_interleave(group, 1))
            x = x + lin(out.reshape(n, -1), "attn_output")
            h = self.norm(x, f"blk.{i}.ffn_norm.weight")
            x = x + lin(torch.nn.functional.silu(lin(h, "ffn_gate")) * lin(h, "ffn_up"), "ffn_down")
        head = "output.weight" if "output.weight" in self.w else "token_embd.weight"
        return self.linear(self.norm(x[first:], "output_norm.weight"), head, act)


def llama_cpp_run(binary: Path, gguf: Path, text: Path, ctx: int, threads: int) -> tuple[float, list[int], np.ndarray]:
    """llama-perplexity's perplexity, its token ids and the NLL `[chunks, ctx - 1 - ctx/2]` of each token it scored
    (its log-probs file stores them in 16 bits over the 16 nats below the best: 2.4e-4 nats; the perplexity the
    same, from the file, where its printed estimate is lost)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "logits.bin"
        command = [binary, "-m", gguf, "-f", text, "-c", ctx, "-b", ctx, "-t", threads, "--kl-divergence-base", out]
        done = subprocess.run([str(c) for c in command], capture_output=True, text=True, check=True, env=peer_env())
        found = re.search(r"Final estimate: PPL = ([0-9.]+)", done.stdout + done.stderr)
        head = np.fromfile(out, np.int32, 3, offset=8)
        n_ctx, vocab, chunks = (int(v) for v in head)
        tokens = np.fromfile(out, np.int32, chunks * n_ctx, offset=20)
        scored, row = n_ctx - 1 - n_ctx // 2, 2 * ((vocab + 1) // 2) + 4
        data = np.memmap(out, np.uint16, "r", offset=20 + 4 * chunks * n_ctx, shape=(chunks, scored, row))
        targets = tokens.reshape(chunks, n_ctx)[:, n_ctx // 2 + 1 :]
        nll = np.empty((chunks, scored))
        for c in range(chunks):
            scale, low = np.ascontiguousarray(data[c, :, :4]).view(np.float32).T
            nll[c] = -(scale * data[c, np.arange(scored), 4 + targets[c]] + low)
        del data
    # llama.cpp logs from a thread of its own, whose last lines a busy machine can lose at exit: then the file's
    ppl = float(found[1]) if found else math.exp(nll.mean())
    return ppl, tokens.tolist(), nll


def chunk_nll(logits_of, tokens: list[int], ctx: int) -> np.ndarray:
    """llama-perplexity's procedure: `[chunks, ctx - 1 - ctx/2]` NLLs, each chunk's second half scored."""
    first, rows = ctx // 2, []
    for start in range(0, len(tokens) - ctx + 1, ctx):
        chunk = tokens[start : start + ctx]
        logprobs = logits_of(chunk, first)[: ctx - 1 - first].double().log_softmax(-1)
        rows.append(-logprobs.gather(1, torch.tensor(chunk[first + 1 :])[:, None])[:, 0].numpy())
    return np.stack(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--llama-cpp", type=Path, default=Path.home() / ".cache/tiffin-peers/llama.cpp")
    ap.add_argument("--text", type=Path, required=True)
    ap.add_argument("--configs", default="plain,act,act+kv16")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    binary = args.llama_cpp / "build/bin/llama-perplexity"
    if not binary.exists():
        ap.error(f"no llama.cpp at {args.llama_cpp} (build/bin/llama-perplexity)")
    their_ppl, tokens, theirs = llama_cpp_run(binary, args.gguf, args.text, args.ctx, args.threads)
    model, rows = Reference(args.gguf), []
    ppl = lambda nll: math.exp(nll.mean())
    for config in args.configs.split(","):
        act, kv16 = "act" in config, "kv16" in config
        ours = chunk_nll(lambda chunk, first, a=act, k=kv16: model.logits(chunk, first, a, k), tokens, args.ctx)
        per_chunk = (theirs - ours).mean(1)
        rows.append({
            "config": config, "perplexity": f"{ppl(ours):.4f}", "llama.cpp": f"{their_ppl:.4f}",
            "gap": f"{ppl(ours) / their_ppl - 1:+.2%}",
            "standard error (nats)": f"{per_chunk.std(ddof=1) / math.sqrt(len(per_chunk)):.4f}",
            "mean abs NLL difference a token": f"{np.abs(theirs - ours).mean():.4f}",
        })  # fmt: skip
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
