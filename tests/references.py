"""Reference runs the tests compare tiffin with: transformers' greedy generation, and the event loop's longest stall
while an app answers a request."""

import asyncio
import time

import httpx
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


def max_loop_lag(app, method: str, path: str, **request) -> tuple[float, httpx.Response]:
    """The longest the event loop went unanswered while `app` served one request, and its response."""

    async def run():
        lag, stop = 0.0, asyncio.Event()

        async def ticker():
            nonlocal lag
            while not stop.is_set():
                before = time.monotonic()
                await asyncio.sleep(0.01)
                lag = max(lag, time.monotonic() - before - 0.01)

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0.05)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
            r = await c.request(method, path, **request)
        stop.set()
        await tick
        return lag, r

    return asyncio.run(run())
