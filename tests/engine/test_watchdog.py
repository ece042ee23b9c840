"""The engine watchdog (engine_stall_timeout): a step made to hang fails the requests in flight with EngineStalled
and reports the engine dead within the timeout, and once the step ends the engine serves again; a slow engine
whose steps each finish, and an idle one, never trip it."""

import asyncio
import threading
import time

import pytest

from tiffin import AsyncLLMEngine, SamplingParams
from tiffin.engine.config import EngineConfig
from tiffin.engine.errors import EngineError, EngineStalled

TIMEOUT = 1.0
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


@pytest.fixture
def engine(tiny_model):
    ages: list[float] = []
    engine = AsyncLLMEngine.from_engine_args(
        tiny_model("llama"), num_kv_blocks=64, engine_stall_timeout=TIMEOUT, on_step_age=ages.append
    )
    engine.ages = ages
    yield engine
    engine.shutdown()


def hang_steps(monkeypatch, engine) -> tuple[threading.Event, threading.Event]:
    """(hung, release): once armed, the model runner's next step sets `hung` and waits for `release`."""
    runner = engine.engine.model_runner
    execute, hung, release = runner.execute, threading.Event(), threading.Event()

    def hanging(scheduler_output):
        hung.set()
        release.wait(30)
        return execute(scheduler_output)

    monkeypatch.setattr(runner, "execute", hanging)
    return hung, release


async def _collect(engine, prompt, params, request_id):
    return [out async for out in engine.generate(prompt, params, request_id)]


async def _until(predicate, timeout: float) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, "timed out"
        await asyncio.sleep(0.02)
    return time.monotonic() - start


def test_a_hung_step_fails_the_requests_in_flight_then_the_engine_serves_again(engine, monkeypatch):
    async def run():
        first = asyncio.create_task(_collect(engine, "Hello", LONG, "a"))
        await _until(lambda: engine.stats().num_running == 1, 5)
        hung, release = hang_steps(monkeypatch, engine)
        second = asyncio.create_task(_collect(engine, "The quick brown fox", LONG, "b"))
        await asyncio.to_thread(hung.wait, 5)
        started = time.monotonic()
        await _until(lambda: engine.dead is not None, TIMEOUT + 1)
        tripped = time.monotonic() - started
        assert not engine.healthy and "engine stalled" in engine.dead and "engine_stall_timeout=1 s" in engine.dead
        assert "while 2 requests were in flight" in engine.dead
        errors = await asyncio.gather(first, second, return_exceptions=True)
        with pytest.raises(EngineStalled, match="no engine step finished"):  # new requests are refused meanwhile
            await _collect(engine, "Hello", LONG, "c")
        release.set()
        await _until(lambda: engine.dead is None, 5)
        monkeypatch.undo()
        after = await _collect(engine, "Hello", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), "d")
        return tripped, errors, after

    tripped, errors, after = asyncio.run(run())
    assert TIMEOUT - 0.2 < tripped < TIMEOUT + 1  # the timeout, plus up to a check interval (a quarter of it)
    for error in errors:
        assert isinstance(error, EngineStalled) and isinstance(error, EngineError)
        assert str(error) == "no engine step finished in 1 s while 2 requests were in flight"
    assert after[-1].finished and len(after[-1].outputs[0].token_ids) == 5
    stats = engine.stats()  # the failed requests were aborted once the step ended: their blocks are free
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_blocks_used == 0
    assert engine.healthy and max(engine.ages) > TIMEOUT  # the gauge saw the stalled step's age


def test_wedged_outside_a_step_is_reported_and_clears_when_it_ends(engine, monkeypatch):
    """The engine thread stuck holding its lock (here: adding a request) cannot have its requests failed for it,
    but the stall is reported, and forgotten once the thread moves on."""
    add, release = engine.engine.add_request, threading.Event()

    def hanging_add(*args):
        release.wait(30)
        return add(*args)

    async def run():
        first = asyncio.create_task(_collect(engine, "Hello", LONG, "a"))
        await _until(lambda: engine.stats().num_running == 1, 5)
        monkeypatch.setattr(engine.engine, "add_request", hanging_add)
        second = asyncio.create_task(_collect(engine, "Hello", SamplingParams(max_tokens=3), "b"))
        await _until(lambda: engine.dead is not None, TIMEOUT + 3)  # the trip waits a second for the lock
        assert "engine stalled" in engine.dead
        release.set()
        await _until(lambda: engine.dead is None, 5)
        return await asyncio.gather(first, second)

    first, second = asyncio.run(run())
    assert first[-1].finished and second[-1].finished and engine.healthy


def test_slow_steps_that_finish_never_trip_it(engine, monkeypatch):
    runner = engine.engine.model_runner
    execute = runner.execute

    def slow(scheduler_output):
        time.sleep(0.5)
        return execute(scheduler_output)

    monkeypatch.setattr(runner, "execute", slow)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    started = time.monotonic()
    outs = asyncio.run(_collect(engine, "Hello", params, "slow"))
    assert time.monotonic() - started > 2 * TIMEOUT  # the request outlasts the timeout; no step does
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 5
    assert engine.healthy


def test_an_idle_engine_never_trips_it(engine):
    time.sleep(2.5 * TIMEOUT)
    assert engine.healthy and engine.dead is None
    assert engine.ages and max(engine.ages) == 0
    outs = asyncio.run(_collect(engine, "Hello", SamplingParams(max_tokens=3, ignore_eos=True), "idle"))
    assert outs[-1].finished


def test_off_and_refused_settings(tiny_model):
    assert EngineConfig(model="m").engine_stall_timeout == 120
    for off in (0, None):
        engine = AsyncLLMEngine.from_engine_args(tiny_model("llama"), num_kv_blocks=16, engine_stall_timeout=off)
        try:
            assert engine._watchdog.timeout is None and not engine._watchdog.stalled()
        finally:
            engine.shutdown()
    with pytest.raises(ValueError, match="engine_stall_timeout must be >= 0"):
        EngineConfig(model="m", engine_stall_timeout=-1)
