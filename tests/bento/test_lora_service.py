"""LoRA through a real `bentoml serve`: adapters loaded and unloaded at runtime over vLLM's endpoints, served by
`model` name with PEFT's text, listed under the base model, loaded while another request streams, and every
unsafe or broken load refused with a 4xx while serving goes on.

The server serves the built-in tiny llama (byte-identical to the `tiny_model("llama")` checkpoint the adapters
are built for) with TIFFIN_LORA_ROOTS set to a scratch directory."""

import os
import shutil
import threading
import time

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("bentoml")

from lora_adapters import ADAPTERS, PeftReference, make_adapter  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from tiffin.tiny import IM_END_ID  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

MODEL = "tiffin-tiny-llama"
PROMPT = "The quick brown fox"
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    """Adapters inside the root, a few outside it, and PEFT's reference holding the good ones."""
    base = tiny_model("llama")
    root, outside = tmp_path_factory.mktemp("lora-root"), tmp_path_factory.mktemp("lora-outside")
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    good = {
        name: make_adapter(base, root / name, seed=i, model=hf, **kw) for i, (name, kw) in enumerate(ADAPTERS.items())
    }
    good["late"] = make_adapter(
        base, root / "nested" / "late", seed=5, model=hf, r=4, lora_alpha=8, target_modules=["o_proj", "up_proj"]
    )
    bad = {"outside": make_adapter(base, outside / "outside", seed=9, model=hf, r=4, target_modules=["q_proj"])}
    os.symlink(bad["outside"], root / "link-out")
    bad["rank-32"] = make_adapter(base, root / "rank-32", seed=1, model=hf, r=32, target_modules=["q_proj"])
    bad["wrong-shape"] = make_adapter(base, root / "wrong-shape", seed=2, model=hf, r=4, target_modules=["v_proj"])
    tensors = load_file(bad["wrong-shape"] / "adapter_model.safetensors")
    save_file(
        {k: torch.cat([v, v]) if "lora_B" in k else v for k, v in tensors.items()},
        bad["wrong-shape"] / "adapter_model.safetensors",
    )
    bad["pickle"] = shutil.copytree(good["qv-r8"], root / "pickle")
    (bad["pickle"] / "adapter_model.safetensors").rename(bad["pickle"] / "adapter_model.bin")
    bad["no-weights"] = root / "no-weights"
    bad["no-weights"].mkdir()
    (bad["no-weights"] / "adapter_config.json").write_text((good["qv-r8"] / "adapter_config.json").read_text())
    bad["dora"] = make_adapter(base, root / "dora", seed=3, model=hf, r=4, target_modules=["q_proj"], use_dora=True)
    (root / "inner").mkdir()
    os.symlink(outside / "outside" / "adapter_model.safetensors", root / "inner" / "adapter_model.safetensors")
    shutil.copy(good["qv-r8"] / "adapter_config.json", root / "inner" / "adapter_config.json")
    ref = PeftReference(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), good)
    return root, good, bad, ref, AutoTokenizer.from_pretrained(base)


@pytest.fixture(scope="module")
def server(adapters, bento_server):
    return bento_server(
        args={"model": MODEL, "num_kv_blocks": 256},
        env={
            "TIFFIN_LORA_ROOTS": str(adapters[0]),
            "TIFFIN_MAX_LORAS": "2",
            "TIFFIN_MAX_LORA_RANK": "16",
            "TIFFIN_MAX_NUM_SEQS": "16",
        },
    )


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def peft_text(adapters, name: str | None, prompt: str = PROMPT, n: int = NEW_TOKENS) -> str:
    _, _, _, ref, tok = adapters
    # a final token that ends inside a UTF-8 character decodes to U+FFFD here; the server holds such bytes back
    return tok.decode(ref.generate(tok.encode(prompt), name, n), skip_special_tokens=True).rstrip("\ufffd")


def load(server, name, path) -> "httpx.Response":  # noqa: F821
    return server.http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})


def complete(client, model, prompt=PROMPT, n=NEW_TOKENS) -> str:
    resp = client.completions.create(
        model=model, prompt=prompt, max_tokens=n, temperature=0, extra_body={"ignore_eos": True}
    )
    assert resp.model == model
    return resp.choices[0].text


def model_ids(client) -> dict[str, str | None]:
    return {m.id: getattr(m, "parent", None) for m in client.models.list().data}


def test_load_and_serve_each_adapter_by_name(server, client, adapters):
    root, good, _, _, _ = adapters
    assert model_ids(client) == {MODEL: None}
    for name in ADAPTERS:
        r = load(server, name, good[name].relative_to(root) if name == "qv-r8" else good[name])
        assert r.status_code == 200, r.text
    assert model_ids(client) == {MODEL: None, **{name: MODEL for name in ADAPTERS}}
    texts = {name: complete(client, name) for name in [MODEL, *ADAPTERS]}
    for name, text in texts.items():
        assert text == peft_text(adapters, None if name == MODEL else name), name
    assert len(set(texts.values())) == len(texts)  # every adapter changes the output
    chat = client.chat.completions.create(
        model="all-rslora-r16", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0
    )
    _, _, _, ref, tok = adapters
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    want = ref.generate(tok.encode(text, add_special_tokens=False), "all-rslora-r16", 8)
    want = want[: want.index(IM_END_ID)] if IM_END_ID in want else want  # the server stops at eos
    assert chat.choices[0].message.content == tok.decode(want, skip_special_tokens=True)


def test_concurrent_requests_mix_adapters(server, client, adapters):
    """More adapters than the server's 2 slots, requested at once: all served, each with its own text."""
    names = [MODEL, *ADAPTERS] * 2
    results = {}

    def run(i, name):
        results[i] = complete(client, name, n=12)

    threads = [threading.Thread(target=run, args=(i, n)) for i, n in enumerate(names)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, name in enumerate(names):
        assert results[i] == peft_text(adapters, None if name == MODEL else name, n=12), name


def test_load_is_idempotent_per_name_and_path(server, adapters):
    _, good, _, _, _ = adapters
    assert load(server, "qv-r8", good["qv-r8"]).status_code == 200
    r = load(server, "qv-r8", good["mlp-patterns"])
    assert r.status_code == 409 and "already loaded" in r.json()["error"]["message"]


def test_load_while_another_request_streams(server, client, adapters):
    _, good, _, _, _ = adapters
    stream = client.completions.create(
        model="qv-r8", prompt=PROMPT, max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = iter(stream)
    text = next(chunks).choices[0].text
    started = time.monotonic()
    assert load(server, "late", good["late"]).status_code == 200
    loaded_after = time.monotonic() - started
    after_load = [c.choices[0].text for c in chunks]
    text += "".join(after_load)
    assert len(after_load) > 1, "the stream ended before the load returned"
    assert text == peft_text(adapters, "qv-r8", n=400)
    assert complete(client, "late") == peft_text(adapters, "late")
    assert loaded_after < 30


REFUSALS = {  # name -> (lora_path as sent, status, message fragment)
    "outside": (lambda root, bad: bad["outside"], 400, "outside the LoRA roots"),
    "dotdot": (lambda root, bad: f"{root}/../{bad['outside'].parent.name}/outside", 400, "'..'"),
    "dotdot-relative": (lambda root, bad: "../x", 400, "'..'"),
    "symlink-dir": (lambda root, bad: root / "link-out", 400, "symlinks"),
    "symlink-file": (lambda root, bad: root / "inner", 400, "leads outside"),
    "missing": (lambda root, bad: root / "nope", 400, "does not exist"),
    "not-a-dir": (lambda root, bad: bad["pickle"] / "adapter_config.json", 400, "not a directory"),
    "pickle": (lambda root, bad: bad["pickle"], 400, "only safetensors"),
    "no-weights": (lambda root, bad: bad["no-weights"], 400, "no adapter_model.safetensors"),
    "rank-32": (lambda root, bad: bad["rank-32"], 400, "exceeds max_lora_rank 16"),
    "wrong-shape": (lambda root, bad: bad["wrong-shape"], 400, "do not fit"),
    "dora": (lambda root, bad: bad["dora"], 400, "DoRA"),
}


@pytest.mark.parametrize("case", REFUSALS, ids=list(REFUSALS))
def test_unsafe_or_broken_loads_are_refused(case, server, client, adapters):
    root, _, bad, _, _ = adapters
    path, status, fragment = REFUSALS[case]
    before = model_ids(client)
    r = load(server, f"bad-{case}", path(root, bad))
    assert r.status_code == status, r.text
    assert fragment in r.json()["error"]["message"]
    assert model_ids(client) == before
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices  # still serving


@pytest.mark.parametrize(
    "body,status",
    [
        ({"lora_name": "x"}, 400),
        ({"lora_path": "x"}, 400),
        ({"lora_name": 5, "lora_path": "x"}, 400),
        ({"lora_name": MODEL, "lora_path": "qv-r8"}, 400),
        ({"lora_name": " pad", "lora_path": "qv-r8"}, 400),
    ],
)
def test_malformed_load_bodies(server, body, status):
    assert server.http.post("/v1/load_lora_adapter", json=body).status_code == status


def test_unload_then_404(server, client, adapters):
    _, good, _, _, _ = adapters
    assert load(server, "to-drop", good["mlp-patterns"]).status_code == 200
    assert complete(client, "to-drop") == peft_text(adapters, "mlp-patterns")
    r = server.http.post("/v1/unload_lora_adapter", json={"lora_name": "to-drop"})
    assert r.status_code == 200, r.text
    assert "to-drop" not in model_ids(client)
    with pytest.raises(openai.NotFoundError):
        complete(client, "to-drop")
    assert server.http.post("/v1/unload_lora_adapter", json={"lora_name": "to-drop"}).status_code == 404
    assert complete(client, "mlp-patterns") == peft_text(adapters, "mlp-patterns")  # same files, other name


def test_unload_with_a_request_in_flight_lets_it_finish(server, client, adapters):
    _, good, _, _, _ = adapters
    assert load(server, "in-flight", good["all-rslora-r16"]).status_code == 200
    stream = iter(
        client.completions.create(
            model="in-flight",
            prompt=PROMPT,
            max_tokens=300,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    text = next(stream).choices[0].text
    assert server.http.post("/v1/unload_lora_adapter", json={"lora_name": "in-flight"}).status_code == 200
    rest = [c.choices[0].text for c in stream]
    assert len(rest) > 1
    assert text + "".join(rest) == peft_text(adapters, "all-rslora-r16", n=300)
    with pytest.raises(openai.NotFoundError):
        complete(client, "in-flight")
