"""Image chat against transformers on the same tiny random LLaVA checkpoint (`tiffin.testing.tiny_llava`), in one
process, fp32, and the encoder cache's hit rate on a workload that repeats images.

W: `--requests` prompts "USER: <i>. <question>\\n<image> ASSISTANT:" (the image after text of its own: the
  encoder cache, not the prefix cache, finds it again), each with one of `--distinct` random images of
varied sizes (request i: image i mod distinct, question i mod 4), greedy, `--new-tokens` tokens each (ignore_eos).
- TTFT: one request alone, an image neither peer has seen, `max_tokens=1`, preprocessing included (tiffin: the
  engine's decoding of a PIL image, its processor, tower and prefill; transformers: CLIPImageProcessorPil and
  `generate(max_new_tokens=1)`); the median of `--ttft-runs`.
- Throughput: W's output tokens per second; tiffin: `LLM.generate(W)` batched as its scheduler chooses (prefix
  caching on, as served); transformers: `generate` one request at a time (its LLaVA takes one image size per
  batch of pixel values only after padding the prompts; batch 1 is how its pipeline runs).
- Agreement: each request's tiffin tokens against transformers' (greedy fp32: equal but for near-ties).
- Encoder: images run through the tower against image requests (reuse: 1 - their ratio; the workload's best is
  1 - distinct / requests), the encoder cache's lookups, prefix-cache hits (a hit covering an image's
  placeholders needs no encoding at all).
The tiny models make this a measure of per-request overhead (preprocessing, scheduling, Python), not of GEMMs.

    python benchmarks/vision.py [--requests 32] [--distinct 8] [--new-tokens 32] [--image-size 224]
    python benchmarks/vision.py --quick
"""

import argparse  # noqa: I001  (tiffin is imported before torch: it sets torch's OpenMP defaults)
import statistics
import sys
import tempfile
import time
from pathlib import Path

import tiffin  # noqa: F401
import torch

from common import markdown_table
from embeddings import cpu_name

from tiffin import LLM, SamplingParams
from tiffin.testing.images import random_image
from tiffin.testing.tiny_llava import make_tiny_llava

QUESTIONS = ("What is in the picture?", "Describe it.", "Which colours are there?", "Is it a photo?")
QUICK = dict(requests=4, distinct=2, new_tokens=4, ttft_runs=1, image_size=56)


def workload(args) -> list[tuple[str, object]]:
    images = [random_image(100 + i, (args.image_size + 37 * i % 90, args.image_size + 53 * i % 70))
              for i in range(args.distinct)]  # fmt: skip
    return [
        (f"USER: {i}. {QUESTIONS[i % 4]}\n<image> ASSISTANT:", images[i % args.distinct]) for i in range(args.requests)
    ]


def hf_peer(path: Path):
    """transformers' generate over (text, image), preprocessing included: its greedy new token ids."""
    from transformers import AutoTokenizer, CLIPImageProcessorPil, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    tokenizer, processor = AutoTokenizer.from_pretrained(path), CLIPImageProcessorPil.from_pretrained(path)
    image_id, per_image = model.config.image_token_id, (model.config.vision_config.image_size // 14) ** 2

    def generate(text: str, image, new_tokens: int) -> list[int]:
        ids = [t for t0 in tokenizer(text)["input_ids"] for t in ([t0] * per_image if t0 == image_id else [t0])]
        x = torch.tensor([ids])
        pixels = processor([image], return_tensors="pt")["pixel_values"]
        with torch.inference_mode():
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), pixel_values=pixels,
                                 max_new_tokens=new_tokens, do_sample=False)  # fmt: skip
        return out[0, len(ids) :].tolist()

    return generate


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--distinct", type=int, default=8, help="distinct images among the requests")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--image-size", type=int, default=224, help="the tower's input: (size / 14)^2 image tokens")
    ap.add_argument("--ttft-runs", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help=f"a short run: {QUICK}")
    args = ap.parse_args()
    if args.quick:
        vars(args).update(QUICK)
    path = make_tiny_llava(Path(tempfile.mkdtemp()) / "llava", image_size=args.image_size)
    print(f"CPU: {cpu_name()}; torch threads {torch.get_num_threads()}; tiny LLaVA, {args.image_size} px images, "
          f"{(args.image_size // 14) ** 2} tokens each")  # fmt: skip
    w = workload(args)
    llm, hf = LLM(str(path), dtype="float32"), hf_peer(path)
    greedy = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    first = SamplingParams(temperature=0, max_tokens=1)

    def tiffin_one(text, image, params):
        return llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, params, use_tqdm=False)

    fresh = [random_image(900 + i, (args.image_size + 11 * i, args.image_size)) for i in range(2 * args.ttft_runs + 1)]
    tiffin_one("USER: warm-up\n<image> ASSISTANT:", fresh[-1], greedy), hf("USER: <image>", fresh[-1], 2)
    ttft = {
        "tiffin": statistics.median(timed(tiffin_one, w[i][0], fresh[i], first)[1] for i in range(args.ttft_runs)),
        "transformers": statistics.median(
            timed(hf, w[i][0], fresh[args.ttft_runs + i], 1)[1] for i in range(args.ttft_runs)
        ),
    }
    encoder = llm.llm_engine.model_runner.encoder
    encoder.reset()
    prefix_hits = llm.llm_engine.stats().prefix_cache_hits
    prompts = [{"prompt": text, "multi_modal_data": {"image": image}} for text, image in w]
    outs, tiffin_s = timed(llm.generate, prompts, greedy, False)
    encoded, hits, misses = encoder.num_encoded, encoder.cache.hits, encoder.cache.misses
    prefix_hits = llm.llm_engine.stats().prefix_cache_hits - prefix_hits
    reference, hf_s = timed(lambda: [hf(text, image, args.new_tokens) for text, image in w])
    equal = sum(o.outputs[0].token_ids == ref for o, ref in zip(outs, reference))
    tokens = args.requests * args.new_tokens
    columns = ["peer", "TTFT ms (median)", "output tok/s", "W s", "TTFT speed-up", "throughput ratio"]
    rows = [
        ["tiffin", f"{ttft['tiffin'] * 1e3:.1f}", f"{tokens / tiffin_s:.0f}", f"{tiffin_s:.2f}",
         f"{ttft['transformers'] / ttft['tiffin']:.2f}x", f"{hf_s / tiffin_s:.2f}x"],
        ["transformers (batch 1)", f"{ttft['transformers'] * 1e3:.1f}", f"{tokens / hf_s:.0f}", f"{hf_s:.2f}",
         "1", "1"],
    ]  # fmt: skip
    print(markdown_table([dict(zip(columns, row)) for row in rows]))
    print(f"W: {args.requests} requests over {args.distinct} distinct images, {args.new_tokens} tokens each")
    print(f"greedy tokens equal to transformers': {equal} of {args.requests} requests")
    print(f"encoder: {encoded} images through the tower for {args.requests} image requests (reuse "
          f"{1 - encoded / args.requests:.2f}); encoder cache lookups {hits} hits, {misses} misses (a step encodes an "
          f"image its sequences share once); prefix-cache hits {prefix_hits} tokens")  # fmt: skip
    return 0 if equal == args.requests and encoded <= args.distinct else 1


if __name__ == "__main__":
    sys.exit(main())
