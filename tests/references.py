"""Reference runs the tests compare tiffin with: transformers' greedy generation (of text and vision-language
models), and which work ran on the event loop while an app answered a request."""

import asyncio
import threading

import httpx
import pytest
import torch


def reference_generate(hf, prompt: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy `new_tokens` after `prompt` and each one's logprob."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                          output_logits=True, return_dict_in_generate=True)  # fmt: skip
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [torch.log_softmax(logits[0].float(), -1)[t].item() for logits, t in zip(out.logits, tokens)]
    return tokens, logprobs


def reference_vlm(model, inputs: dict, new_tokens: int) -> tuple[list[int], list[float], list[float]]:
    """transformers' greedy `new_tokens` over a vision-language model's processed `inputs` (input_ids, pixel values,
    ...), each one's logprob, and the logprob of each prompt token after the first (from one forward of the
    prompt)."""
    ids = inputs["input_ids"][0]
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)  # fmt: skip
        prompt = torch.log_softmax(model(**inputs).logits[0, :-1].float(), -1)
    tokens = out.sequences[0, len(ids) :].tolist()
    logprobs = [torch.log_softmax(logits[0].float(), -1)[t].item() for logits, t in zip(out.logits, tokens)]
    return tokens, logprobs, prompt[torch.arange(len(ids) - 1), ids[1:]].tolist()


def vision_language_model(path):
    """The transformers model of the checkpoint at `path` (its config's architecture), fp32, never stopping at EOS."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    model = getattr(transformers, config.architectures[0]).from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def work_on_the_loop(app, method: str, path: str, watched: list[tuple[object, str]], **request):
    """Which of the `watched` callables (an object and an attribute name) ran on the event loop's thread while `app`
    served one request, and its response. Which thread did the work, not how long the loop stalled: a stall's
    length is the machine's load as much as the code's."""
    on_loop, loop_thread = set(), threading.get_ident()

    def watch(name, original):
        def call(*args, **kwargs):
            if threading.get_ident() == loop_thread:
                on_loop.add(name)
            return original(*args, **kwargs)

        return call

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
            return await c.request(method, path, **request)

    with pytest.MonkeyPatch.context() as patch:
        for owner, name in watched:
            patch.setattr(owner, name, watch(name, getattr(owner, name)))
        response = asyncio.run(run())
    return sorted(on_loop), response


def spread_weights(model: torch.nn.Module, norm_mean: float, embed_power: float, output_gain: float) -> None:
    """Random weights large enough that greedy decoding wanders (transformers' std 0.02 gives near-uniform
    logits), seeded: norm weights `norm_mean` + 0.1 N(0, 1); embeddings and lm_head 2 N(0, 1) / dim**`embed_power`;
    other weights N(0, 1) / sqrt(fan-in), o_proj and down_proj times `output_gain`."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            x = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(norm_mean + 0.1 * x)
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(x * 2.0 / p.shape[-1] ** embed_power)
            else:
                gain = output_gain if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
                p.copy_(x * gain / p.shape[-1] ** 0.5)
