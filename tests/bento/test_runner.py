"""The legacy Runner: in-process through `Runner.init_local`, and served through `bentoml.runner_service`."""

from pathlib import Path

import pytest

bentoml = pytest.importorskip("bentoml")

from tiffin import LLM, SamplingParams  # noqa: E402
from tiffin.plugin.runner import make_runner  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

PROMPTS = ["Hello, tiffin", "The quick brown fox"]


@pytest.fixture(scope="module")
def expected(tiny_model):
    llm = LLM(tiny_model("llama"), num_kv_blocks=64)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def test_runner_init_local(tiny_model, expected):
    runner = make_runner(str(tiny_model("llama")), num_kv_blocks=64)
    runner.init_local(quiet=True)
    try:
        assert runner.generate.run(PROMPTS[0], max_tokens=12, temperature=0) == expected[0]
        assert runner.generate_batch.run(PROMPTS, max_tokens=12, temperature=0) == expected
        with pytest.raises(ValueError, match="top_p"):
            runner.generate.run(PROMPTS[0], top_p=0)
    finally:
        runner.destroy()


def test_runner_service_over_http(tiny_model, expected, bento_server):
    server = bento_server(
        "legacy_runner_bento:svc",
        env={"TIFFIN_MODEL": str(tiny_model("llama"))},
        working_dir=Path(__file__).parent,
        timeout=120,
    )
    with bentoml.SyncHTTPClient(server.url) as client:
        assert client.generate(prompt=PROMPTS[1], max_tokens=12, temperature=0) == expected[1]
        assert client.generate_batch(prompts=PROMPTS, max_tokens=12, temperature=0) == expected
