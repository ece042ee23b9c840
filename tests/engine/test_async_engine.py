"""AsyncLLMEngine against the offline LLM on the same weights: streamed outputs, stop-string hold-back,
cancellation freeing KV blocks, refused requests, and engine failures that spare the loop."""

import asyncio
import time

import pytest

from tiffin import LLM, AsyncLLMEngine, SamplingParams
from tiffin.engine.errors import EngineError

PROMPTS = ["Hello, tiffin", "The quick brown fox", "def main():"]


@pytest.fixture(scope="module")
def engines(tiny_model):
    """(offline LLM, AsyncLLMEngine over a second engine on the same weights)."""
    llm = LLM(tiny_model("llama"), num_kv_blocks=256)
    async_engine = AsyncLLMEngine.from_engine_args(tiny_model("llama"), num_kv_blocks=256)
    yield llm, async_engine
    async_engine.shutdown()


async def _collect(engine, prompt, params, request_id):
    return [out async for out in engine.generate(prompt, params, request_id)]


async def _wait_idle(engine, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats.num_running == stats.num_waiting == stats.kv_blocks_used == 0:
            return stats
        await asyncio.sleep(0.02)
    return engine.stats()


def test_concurrent_streams_match_offline(engines):
    llm, engine = engines
    params = [
        SamplingParams(temperature=0, max_tokens=24),
        SamplingParams(temperature=0.8, seed=7, max_tokens=17),
        SamplingParams(temperature=1.0, top_k=20, seed=3, max_tokens=30, n=2),
    ]
    expected = llm.generate(PROMPTS, params, use_tqdm=False)

    async def run():
        requests = enumerate(zip(PROMPTS, params))
        return await asyncio.gather(*(_collect(engine, p, sp, f"c{i}") for i, (p, sp) in requests))

    for outs, ref in zip(asyncio.run(run()), expected):
        final = outs[-1]
        assert final.finished and all(not o.finished for o in outs[:-1])
        assert [o.text for o in final.outputs] == [o.text for o in ref.outputs]
        assert [o.token_ids for o in final.outputs] == [o.token_ids for o in ref.outputs]
        assert final.prompt_token_ids == ref.prompt_token_ids
        for seq in range(len(final.outputs)):  # cumulative: every streamed text extends the previous one
            texts = [o.outputs[seq].text for o in outs]
            assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))


def test_stop_string_is_held_back_while_streaming(engines):
    llm, engine = engines
    free = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    stop = free.text[12:15]  # a stop string that greedy decoding will meet, spanning token boundaries or not
    params = SamplingParams(temperature=0, max_tokens=40, stop=[stop])
    ref = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    outs = asyncio.run(_collect(engine, PROMPTS[0], params, "stop"))
    texts = [o.outputs[0].text for o in outs]
    assert texts[-1] == ref.text == free.text[: free.text.index(stop)]
    assert outs[-1].outputs[0].finish_reason == "stop" and outs[-1].outputs[0].stop_reason == stop
    # Nothing streamed is ever retracted, and no streamed text ran into the stop string.
    assert all(ref.text.startswith(t) for t in texts)


def test_cancelling_the_stream_aborts_and_frees_blocks(engines):
    _, engine = engines

    async def run():
        params = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)
        gen = engine.generate(PROMPTS[1], params, "long")
        seen = []
        async for out in gen:
            seen.append(out)
            if len(seen) == 3:
                break
        busy = engine.stats()
        await gen.aclose()
        return seen, busy, await _wait_idle(engine)

    seen, busy, idle = asyncio.run(run())
    assert not seen[-1].finished and busy.kv_blocks_used > 0
    assert idle.num_running == 0 and idle.kv_blocks_used == 0

    async def cancel_task():  # a task cancelled mid-await (what an HTTP disconnect does)
        task = asyncio.create_task(_collect(engine, PROMPTS[1], SamplingParams(max_tokens=900, ignore_eos=True), "t"))
        while engine.stats().num_running == 0:
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return await _wait_idle(engine)

    idle = asyncio.run(cancel_task())
    assert idle.num_running == 0 and idle.kv_blocks_used == 0


def test_abort_ends_the_stream(engines):
    _, engine = engines

    async def run():
        stream = await engine.add_request("ab", PROMPTS[2], SamplingParams(max_tokens=900, ignore_eos=True))
        first = await stream.__anext__()
        engine.abort("ab")
        return first, [out async for out in stream]

    first, rest = asyncio.run(run())
    assert not first.finished and rest[-1].finished
    assert rest[-1].outputs[0].finish_reason == "abort"


def test_refused_requests_raise_before_streaming(engines):
    _, engine = engines
    vocab = engine.engine.model_config.vocab_size

    async def refused(prompt, params=None, request_id="bad"):
        with pytest.raises(ValueError) as info:
            await engine.add_request(request_id, prompt, params)
        return str(info.value)

    async def run():
        assert "token ids" in await refused([1, vocab])
        assert "token ids" in await refused([-1])
        assert "context length" in await refused([1] * (engine.max_model_len + 1))
        assert "context length" in await refused("hi", SamplingParams(max_tokens=engine.max_model_len))
        stream = await engine.add_request("dup", "hi", SamplingParams(max_tokens=500, ignore_eos=True))
        assert "already in use" in await refused("hi", None, "dup")
        stream.close()
        return await _wait_idle(engine)

    idle = asyncio.run(run())
    assert idle.num_running == 0 and idle.kv_blocks_used == 0


def test_engine_failure_fails_requests_in_flight_not_the_loop(engines, fail_step):
    llm, engine = engines
    fail_step(engine.engine.model_runner, 3, RuntimeError("device lost"))
    with pytest.raises(EngineError, match="device lost"):
        asyncio.run(_collect(engine, PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True), "fail"))
    idle = asyncio.run(_wait_idle(engine))
    assert idle.num_running == 0 and idle.kv_blocks_used == 0
    params = SamplingParams(temperature=0, max_tokens=12)
    after = asyncio.run(_collect(engine, PROMPTS[0], params, "after"))[-1]
    assert after.outputs[0].text == llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].text


def test_a_consumer_behind_gets_the_newest_output_then_the_error():
    """Outputs queued faster than read collapse to the newest (cumulative), but never past an error: the tokens
    generated before a failure reach the client first (a stream lost them once the engine outran it)."""
    from tiffin.engine.async_llm_engine import RequestStream
    from tiffin.engine.outputs import CompletionOutput, RequestOutput

    async def read() -> tuple[list, BaseException | None]:
        stream = RequestStream("r", lambda request_id, wake: None)
        for n in (1, 2, 3):
            outputs = [CompletionOutput(0, "x" * n, list(range(n)))]
            stream.queue.put_nowait(RequestOutput("r", "p", [1], outputs))
        stream.queue.put_nowait(EngineError("device lost"))
        got = []
        try:
            async for out in stream:
                got.append(out.outputs[0].token_ids)
        except EngineError as e:
            return got, e
        return got, None

    got, error = asyncio.run(read())
    assert got == [[0, 1, 2]] and "device lost" in str(error)
