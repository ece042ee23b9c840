"""LoRA affinity at DP=4 on CPU (the tiny llama; four replica processes sharing the cores): a server's adapters are
each read by one replica (`add_lora`), and a mixed workload (four tenants with a system prompt and an adapter each,
and requests without one) keeps each adapter on <= 1.5 replicas on average (issue #51's bar), with one engine's
greedy tokens; routed round-robin, the same workload spreads every adapter (the measure can fail)."""

import pytest
import torch
from lora_adapters import make_adapter

from tiffin import LLM, SamplingParams
from tiffin.engine.lora.request import LoRARequest

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

ENGINE = dict(block_size=4, dtype="float32", max_num_seqs=8, enable_lora=True, max_lora_rank=8, max_cpu_loras=8)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
TENANTS = 4


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model("llama"))


@pytest.fixture(scope="module")
def adapter_dirs(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("tenants")
    return [str(make_adapter(model, root / f"t{i}", seed=20 + i, r=4)) for i in range(TENANTS)]


def workload(adapters: list[LoRARequest], seed: int) -> tuple[list[dict], list[LoRARequest | None]]:
    """Per round, each tenant's request (its system prompt, then its own turn) and one without an adapter,
    interleaved as they would arrive: five rounds."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda n: torch.randint(4, 2000, (n,), generator=g).tolist()
    systems = [draw(24) for _ in adapters]
    prompts, loras = [], []
    for turn in range(5):
        for system, lora in zip(systems, adapters):
            prompts.append({"prompt_token_ids": system + draw(3 + turn)})
            loras.append(lora)
        prompts.append({"prompt_token_ids": draw(7 + turn)})
        loras.append(None)
    return prompts, loras


def replicas_per_adapter(dp, ids: list[int]) -> float:
    held = dp._call_all("list_loras")  # each replica's host cache, asked between its steps
    return sum(sum(i in h for h in held) for i in ids) / len(ids)


@pytest.fixture(scope="module")
def dp_llm(model):
    llm = LLM(model, num_kv_blocks=64, data_parallel_size=4, **ENGINE)
    yield llm
    llm.shutdown()


def test_adapters_stay_on_few_replicas_with_one_engines_tokens(model, adapter_dirs, dp_llm):
    dp = dp_llm.llm_engine
    adapters = [LoRARequest(f"t{i}", 1 + i, path) for i, path in enumerate(adapter_dirs)]
    for lora in adapters:  # as a server's /v1/load_lora_adapter does: read by the replica holding the fewest
        dp.add_lora(lora)
    assert sorted(map(sorted, dp._call_all("list_loras"))) == [[1], [2], [3], [4]]
    prompts, loras = workload(adapters, seed=0)
    got = [o.outputs[0].token_ids for o in dp_llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)]
    spread = replicas_per_adapter(dp, [lora.lora_int_id for lora in adapters])
    print(f"cache_aware: adapters on {spread:.2f} replicas on average")
    assert spread <= 1.5
    assert all(s.prompt_tokens > 0 for s in dp.replica_stats), "a replica served nothing"

    single = LLM(model, num_kv_blocks=256, **ENGINE)
    try:
        want = [o.outputs[0].token_ids for o in single.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)]
    finally:
        single.shutdown()
    assert got == want
    assert got[0] != got[TENANTS] or got[1] != got[TENANTS], "the adapters change nothing"

    # round-robin over the same workload, fresh adapters read per request: each ends up on most replicas
    dp.router.policy = "round_robin"
    try:
        fresh = [LoRARequest(f"rr{i}", 11 + i, path) for i, path in enumerate(adapter_dirs)]
        prompts, loras = workload(fresh, seed=1)
        dp_llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
        rr = replicas_per_adapter(dp, [lora.lora_int_id for lora in fresh])
    finally:
        dp.router.policy = "cache_aware"
    print(f"round_robin: adapters on {rr:.2f} replicas on average")
    assert rr > 1.5
    assert not dp.requests and dp.stats().kv_blocks_used == 0
