"""Priorities and fair share across data-parallel replicas, DP=2 on CPU (`scheduling_policy=priority`,
`fair_share`, four seats per replica; one module-wide engine): one key's flood holding every seat of both replicas
does not keep another key's requests waiting on any replica (each starts the step after its replica takes it, the
two spread over the replicas although they share a prompt prefix); a high-priority request goes to the replica whose
work it overtakes rather than the one with less work of its own priority, is seated there before every
lower-priority request waiting, and is never preempted while the lower-priority work around it is; outputs equal
one engine's; no block held after.

Counted in each replica's own steps, read from its reports to the front (one per step, with the sequences it had
taken in all), not in time: a replica's step log says when it took a request and when that request's tokens came."""

import pytest
import torch

from tiffin import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

BLOCKS = 80  # per replica: three low-priority requests running on beside an urgent one run out of blocks
ENGINE = dict(
    block_size=4,
    dtype="float32",
    max_num_seqs=4,
    scheduling_policy="priority",
    fair_share=True,
    prefill_first=False,  # every running sequence decodes every step: a gap in its tokens is a preemption
)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(4, 2000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(max_tokens: int, priority: int = 0) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, priority=priority)


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model("llama"))


@pytest.fixture(scope="module")
def single(model):
    llm = LLM(model, num_kv_blocks=2 * BLOCKS, **ENGINE)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def dp(model):
    llm = LLM(model, num_kv_blocks=BLOCKS, data_parallel_size=2, **ENGINE)
    yield llm.llm_engine
    llm.shutdown()


@pytest.fixture(autouse=True)
def no_blocks_held_after(dp):
    yield
    assert not dp.requests and dp.stats().kv_blocks_used == 0


class StepLog:
    """Each replica's steps as the front received them: (sequences taken in all, {request id: output tokens} of
    the unfinished ones, the ids that finished)."""

    def __init__(self, dp, monkeypatch):
        self.dp, self.steps = dp, [[] for _ in dp.conns]
        apply = dp._apply

        def logged(rank: int, message: tuple):
            if message[0] == "step":
                got = {o.request_id: len(o.outputs[0].token_ids) for o in message[1] if not o.finished}
                self.steps[rank].append((message[5][0], got, {o.request_id for o in message[1] if o.finished}))
            return apply(rank, message)

        monkeypatch.setattr(dp, "_apply", logged)
        self.outputs: dict[str, list[int]] = {}
        self.sent: dict[str, int] = {}  # request id -> its replica's sequences sent in all, once it was sent

    def add(self, rid: str, prompt: list[int], params: SamplingParams, client: str | None = None) -> int:
        self.dp.add_request(rid, {"prompt_token_ids": prompt}, params, client=client)
        replica = self.dp.requests[rid].replica
        self.sent[rid] = self.dp.queue.sent[replica]
        return replica

    def step_until(self, done) -> None:
        while not done():
            for out in self.dp.step():
                if out.finished:
                    assert out.error is None, out.error
                    self.outputs[out.request_id] = out.outputs[0].token_ids

    def started(self, *rids: str) -> bool:
        return all(rid in self.outputs or self.dp.requests[rid].group[2] for rid in rids)

    def taken(self, rank: int, rid: str) -> int:
        """The step of replica `rank` that came first after it took `rid`."""
        return next(i for i, (taken, _, _) in enumerate(self.steps[rank]) if taken >= self.sent[rid])

    def ran(self, rank: int, rid: str) -> list[int]:
        """The steps of replica `rank` in which `rid` got tokens (its last one aside)."""
        return [i for i, (_, got, _) in enumerate(self.steps[rank]) if rid in got]

    def admitted(self, rank: int, step: int) -> set[str]:
        """The requests that got tokens at `step` but not at the step before: admitted, or resumed."""
        before = self.steps[rank][step - 1][1] if step else {}
        return set(self.steps[rank][step][1]) - set(before)

    def preempted(self, rank: int, step: int) -> set[str]:
        """The requests that got tokens at the step before `step` and none at `step`, without finishing."""
        _, got, finished = self.steps[rank][step]
        return set(self.steps[rank][step - 1][1]) - set(got) - finished


def test_one_keys_flood_does_not_hold_another_keys_requests_on_any_replica(dp, single, monkeypatch):
    log, flood = StepLog(dp, monkeypatch), [f"a{i}" for i in range(12)]
    prompts = {rid: tokens(24, i) for i, rid in enumerate(flood)}
    for rid in flood:
        log.add(rid, prompts[rid], greedy(48), client="a")
    log.step_until(lambda: sum(dp.requests[rid].group[2] for rid in flood) >= 8)  # every seat of both taken
    system = tokens(32, 100)
    replicas = []
    for i in range(2):  # the same system prompt: the cache alone would keep both on one replica
        prompts[f"b{i}"] = system + tokens(4, 200 + i)
        replicas.append(log.add(f"b{i}", prompts[f"b{i}"], greedy(16), client="b"))
    log.step_until(lambda: not dp.has_unfinished_requests())
    assert sorted(replicas) == [0, 1]
    for rid, rank in zip(["b0", "b1"], replicas):
        # a newcomer on its replica: one of key a's sequences preempted for it, so its first token the next step
        assert log.ran(rank, rid)[0] - log.taken(rank, rid) == 0, (rid, log.taken(rank, rid), log.ran(rank, rid))
    reference = single.generate([{"prompt_token_ids": p} for p in prompts.values()], greedy(48), use_tqdm=False)
    expected = {rid: out.outputs[0].token_ids[: len(log.outputs[rid])] for rid, out in zip(prompts, reference)}
    assert {rid: log.outputs[rid] for rid in prompts} == expected
    assert [len(log.outputs[rid]) for rid in prompts] == [48] * 12 + [16, 16]


def test_a_high_priority_request_goes_where_it_overtakes_and_is_never_preempted(dp, single, monkeypatch):
    log, shared, prompts, params = StepLog(dp, monkeypatch), tokens(8, 300), {}, {}

    def add(rid: str, prompt: list[int], p: SamplingParams) -> int:
        prompts[rid], params[rid] = prompt, p
        return log.add(rid, prompt, p)

    # sharing 8 tokens of prompt: the cache keeps them together; low0 leaves its seat first
    low = lambda i, max_tokens: add(f"low{i}", shared + tokens(56, 400 + i), greedy(max_tokens, priority=5))
    lows = [low(i, 8 if i == 0 else 96) for i in range(4)]
    log.step_until(lambda: log.started(*(f"low{i}" for i in range(4))))  # one replica's seats, all of them
    mids = [add(f"mid{i}", [7, 8, 9, 10] + tokens(4, 500 + i), greedy(24)) for i in range(4)]
    waiting = [low(i, 40) for i in (4, 5)]
    (x,), (y,) = set(lows), set(mids)
    assert x != y and waiting == [x, x]  # lows on x (the cache keeps them there), the mids on y
    # x holds more tokens, y more of the urgent request's own priority: x is where it waits behind nothing
    assert dp.loads[x] > dp.loads[y]
    assert add("urgent", tokens(8, 600), greedy(40)) == x
    log.step_until(lambda: not dp.has_unfinished_requests())
    ran, taken = log.ran(x, "urgent"), log.taken(x, "urgent")
    overtaken = set().union(*(log.admitted(x, s) for s in range(taken, ran[0])))
    assert not overtaken, overtaken  # no lower-priority request admitted or resumed while it waited
    assert ran == list(range(ran[0], ran[0] + 39)), ran  # a token every step from its first: never preempted
    preempted = set().union(*(log.preempted(x, s) for s in ran[1:]))
    assert preempted and preempted <= {f"low{i}" for i in range(6)}, preempted  # lower-priority ones were
    rids = list(prompts)
    reference = single.generate([{"prompt_token_ids": prompts[r]} for r in rids], [params[r] for r in rids], False)
    assert [log.outputs[rid] for rid in rids] == [out.outputs[0].token_ids for out in reference]
