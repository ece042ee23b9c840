"""Scheduling policies through LLMEngine on the tiny model: a priority request overtakes the queue, fair share
splits the output tokens between clients whatever their request counts. Counted in steps and tokens."""

import asyncio
from collections import Counter

import pytest

from tiffin import AsyncLLMEngine
from tiffin.engine.config import EngineConfig
from tiffin.engine.errors import ParamError, QueueFull
from tiffin.engine.llm_engine import LLMEngine
from tiffin.engine.sampling_params import SamplingParams


def make_engine(tiny_model, **config) -> LLMEngine:
    return LLMEngine(EngineConfig(model=tiny_model("llama"), dtype="float32", **config))


def params(priority: int = 0, max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, priority=priority)


def prompt(i: int) -> dict:
    return {"prompt_token_ids": [1 + i % 50, 2, 3, 4 + i % 7]}


def run_to_the_end(engine: LLMEngine) -> dict[str, int]:
    """Step until every request finished: the step (from 1) at which each got its first token."""
    first_token_step, step = {}, 0
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            if out.outputs[0].token_ids:
                first_token_step.setdefault(out.request_id, step)
    return first_token_step


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_a_priority_request_gets_its_first_token_before_the_queued_ones(tiny_model, policy):
    engine = make_engine(tiny_model, max_num_seqs=2, scheduling_policy=policy)
    for i, max_tokens in enumerate([4, 12]):  # they leave their seats one at a time
        engine.add_request(f"running{i}", prompt(i), params(10, max_tokens))
    engine.step()
    assert len(engine.scheduler.running) == 2  # every seat taken by priority 10
    queued = [f"queued{i}" for i in range(4)]
    for i, rid in enumerate(queued):
        engine.add_request(rid, prompt(2 + i), params(10))
    engine.add_request("urgent", prompt(9), params(0))
    first_token_step = run_to_the_end(engine)
    if policy == "priority":
        assert all(first_token_step["urgent"] < first_token_step[rid] for rid in queued), first_token_step
    else:  # arrival order: it waits for all of them
        assert all(first_token_step["urgent"] > first_token_step[rid] for rid in queued), first_token_step


def tokens_while_both_wait(engine: LLMEngine, clients: dict[str, int], max_steps: int) -> Counter:
    """Add `clients`' requests (count each, in that order), then step while every client has a waiting request
    (at most `max_steps`): the output tokens each client got over those steps."""
    client_of, num_tokens, tokens = {}, {}, Counter()
    for client, count in clients.items():
        for i in range(count):
            rid = f"{client}{i}"
            engine.add_request(rid, prompt(len(client_of)), params(max_tokens=8), client=client)
            client_of[rid] = client
    for _ in range(max_steps):
        if {s.client for s in engine.scheduler.waiting} != set(clients):
            break
        for out in engine.step():
            got = len(out.outputs[0].token_ids)
            tokens[client_of[out.request_id]] += got - num_tokens.get(out.request_id, 0)
            num_tokens[out.request_id] = got
    return tokens


def test_fair_share_splits_the_throughput_between_clients(tiny_model):
    clients = {"busy": 60, "light": 6}  # 10:1, the busy client's burst first
    fair = tokens_while_both_wait(make_engine(tiny_model, max_num_seqs=4, fair_share=True), clients, 200)
    assert fair["light"] >= 20 and abs(fair["busy"] - fair["light"]) <= 0.2 * max(fair.values()), fair
    fcfs = tokens_while_both_wait(make_engine(tiny_model, max_num_seqs=4), clients, 30)
    assert fcfs["busy"] >= 20 and fcfs["light"] == 0, fcfs


def test_fair_share_holds_across_priority_levels(tiny_model):
    """A burst of the most urgent priority from one client does not starve another's (issue #50, defect 4):
    seats go to the client holding fewest; its priority orders only its own requests."""
    engine = make_engine(tiny_model, max_num_seqs=4, scheduling_policy="priority", fair_share=True)
    for i in range(12):  # seats free one at a time
        engine.add_request(f"busy{i}", prompt(i), params(priority=-1, max_tokens=4 + i), client="busy")
    engine.step()
    engine.add_request("light-late", prompt(20), params(priority=5, max_tokens=8), client="light")
    engine.add_request("light", prompt(21), params(priority=0, max_tokens=8), client="light")
    first_token_step = run_to_the_end(engine)
    assert first_token_step["light"] <= 6, first_token_step  # the first seat that frees (busy0's 4 tokens)
    assert first_token_step["light"] < first_token_step["light-late"]  # priority orders the client's own
    assert first_token_step["light"] < max(first_token_step[f"busy{i}"] for i in range(12))


def test_a_newcomer_gets_a_seat_at_once_when_one_client_holds_them_all(tiny_model):
    """Long requests of one client hold every seat: another client's request starts the next step, one of the
    holder's sequences preempted (recomputed later from the prefix cache), not once a long one ends."""
    engine = make_engine(tiny_model, max_num_seqs=4, fair_share=True)
    for i in range(6):
        engine.add_request(f"long{i}", prompt(i), params(max_tokens=40), client="busy")
    for _ in range(3):
        engine.step()
    engine.add_request("short", prompt(9), params(max_tokens=2), client="light")
    steps = 0
    while "short" in engine.requests:
        steps += 1
        engine.step()
    assert steps <= 3 and engine.scheduler.num_preemptions == 1, (steps, engine.scheduler.num_preemptions)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    assert all(len(outputs[f"long{i}"].outputs[0].token_ids) == 40 for i in range(6))


def test_each_client_has_a_share_of_the_waiting_queue(tiny_model):
    engine = make_engine(tiny_model, max_num_seqs=2, max_waiting_requests=20, max_waiting_per_client=6)
    many = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, n=3)
    engine.add_request("a0", prompt(0), many, client="a")
    engine.add_request("a1", prompt(1), many, client="a")
    with pytest.raises(QueueFull, match="max_waiting_per_client=6"):  # n counts: 6 + 3 > 6
        engine.add_request("a2", prompt(2), many, client="a")
    engine.add_request("b0", prompt(3), many, client="b")  # another key still gets in
    for i in range(3):  # anonymous requests are bound by max_waiting_requests only
        engine.add_request(f"anonymous{i}", prompt(4 + i), many)
    with pytest.raises(ParamError, match="never fit max_waiting_per_client") as refused:
        engine.add_request("a3", prompt(2), SamplingParams(max_tokens=4, n=7), client="b")
    assert refused.value.param == "n" and "a2" not in engine.requests and "a3" not in engine.requests
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("a2", prompt(2), many, client="a")  # room again once its sequences ran


def test_async_engine_hands_the_client_to_the_engine_thread(tiny_model, monkeypatch):
    engine = AsyncLLMEngine.from_engine_args(tiny_model("llama"), fair_share=True)
    scheduler, clients = engine.engine.scheduler, []
    add = scheduler.add
    monkeypatch.setattr(scheduler, "add", lambda seq: clients.append(seq.client) or add(seq))

    async def generate(client: str | None) -> bool:
        return [out async for out in engine.generate(prompt(0), params(max_tokens=2), client=client)][-1].finished

    try:
        assert asyncio.run(generate("alice")) and asyncio.run(generate(None))
    finally:
        engine.shutdown()
    assert clients == ["alice", None]
