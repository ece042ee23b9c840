import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest

# Under pytest-xdist (`-n 2`) the workers share CI's two cores: each runs one thread per pool. Two workers of two
# threads would oversubscribe the cores, and the pools' threads then spin waiting for a descheduled one (the
# Triton interpreter's dots run in numpy's OpenBLAS: an emulated CUDA-graph test took 5x as long). OpenBLAS reads
# its count when numpy loads, which torch's import does: set here, before it.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
import torch  # noqa: E402

if TYPE_CHECKING:
    from fastapi import FastAPI

    from tiffin import AsyncLLMEngine
    from tiffin.plugin.openai.serving import OpenAIServing

torch.set_num_threads(max(1, 2 // WORKERS))  # two threads on CI's two cores, their share under xdist
# every engine the tests build in-process checks the block manager's invariants after each step
os.environ.setdefault("TIFFIN_CHECK_INVARIANTS", "1")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """`tiny_model(arch)` -> path of the built-in tiny checkpoint for that architecture, written once."""
    from tiffin.tiny import make_tiny_model

    paths = {}

    def get(arch: str = "llama"):
        if arch not in paths:
            paths[arch] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch=arch)
        return paths[arch]

    return get


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory) -> str:
    """The tiny LLaVA checkpoint (`tiffin.testing.tiny_llava`: 56 px images, 16 image tokens), written once."""
    from tiffin.testing.tiny_llava import make_tiny_llava

    return str(make_tiny_llava(tmp_path_factory.mktemp("tiny-llava")))


@pytest.fixture(scope="session")
def tiny_idefics3(tmp_path_factory) -> str:
    """The tiny Idefics3 / SmolVLM checkpoint (`tiffin.testing.tiny_idefics3`: 32 px tiles, 16 image tokens each),
    written once."""
    from tiffin.testing.tiny_idefics3 import make_tiny_idefics3

    return str(make_tiny_idefics3(tmp_path_factory.mktemp("tiny-idefics3")))


@pytest.fixture(scope="session")
def tiny_qwen2_vl(tmp_path_factory) -> str:
    """The tiny Qwen2-VL checkpoint (`tiffin.testing.tiny_qwen2_vl`: one image token per 8 x 8 pixels, 4 to 64 per
    image, M-RoPE), written once."""
    from tiffin.testing.tiny_qwen2_vl import make_tiny_qwen2_vl

    return str(make_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2-vl")))


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl(tmp_path_factory) -> str:
    """The tiny Qwen2.5-VL checkpoint (`tiffin.testing.tiny_qwen2_vl` with `v2_5`: windows of 2 x 2 image tokens)."""
    from tiffin.testing.tiny_qwen2_vl import make_tiny_qwen2_vl

    return str(make_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2-5-vl"), v2_5=True))


@pytest.fixture(scope="session")
def thinking_model(tmp_path_factory):
    """`thinking_model(marker_tokens=False)` -> path of a tiny llama checkpoint that thinks as DeepSeek-R1 does: its
    chat template opens `<think>\n` at the generation prompt, or writes an empty block (`<think>\n\n</think>\n\n`)
    when `enable_thinking` is false. With `marker_tokens`, `<think>` and `</think>` are added tokens (ids
    THINK_TOKEN_IDS); else BPE splits each into several tokens."""
    from tiffin.testing.thinking import make_thinking_model

    paths = {}

    def get(marker_tokens: bool = False):
        if marker_tokens not in paths:
            paths[marker_tokens] = make_thinking_model(tmp_path_factory.mktemp("thinking"), marker_tokens)
        return paths[marker_tokens]

    return get


@dataclass
class InProcessOpenAI:
    """An engine on a tiny checkpoint, the OpenAI serving over it (model name "tiny") and the app, in-process."""

    engine: "AsyncLLMEngine"
    serving: "OpenAIServing"
    app: "FastAPI"

    def __enter__(self) -> "InProcessOpenAI":
        return self

    def __exit__(self, *exc) -> None:
        self.engine.shutdown()


@pytest.fixture(scope="session")
def openai_app(tiny_model):
    """`openai_app(arch="llama", model=None, **engine_args)` -> an `InProcessOpenAI` on the tiny checkpoint of `arch`
    (or on `model`, a path); with `enable_lora`, it serves adapters
    from `lora_roots` as the Bento does. As a context manager it shuts its engine down on exit; an engine still
    running when the session ends is shut down then."""
    made = []

    def make(arch: str = "llama", model: str | None = None, **engine_args) -> InProcessOpenAI:
        from tiffin import AsyncLLMEngine
        from tiffin.plugin.openai.app import create_app
        from tiffin.plugin.openai.serving import OpenAIServing

        engine = AsyncLLMEngine.from_engine_args(model or tiny_model(arch), **engine_args)
        lora = None
        if engine_args.get("enable_lora"):
            from tiffin.plugin.lora import LoRAServing

            lora = LoRAServing(engine, engine_args["lora_roots"], "tiny")
        serving = OpenAIServing(engine, "tiny", lora=lora)
        made.append(InProcessOpenAI(engine, serving, create_app(serving)))
        return made[-1]

    yield make
    for api in made:
        api.engine.shutdown()  # a second shutdown is a no-op


@pytest.fixture
def fail_step(monkeypatch):
    """`fail_step(runner, n, error)`: the model runner's n-th step from now raises `error`; the others run."""

    def arm(runner, n: int, error: Exception) -> None:
        execute, calls = runner.execute, []

        def flaky(scheduler_output):
            calls.append(1)
            if len(calls) == n:
                raise error
            return execute(scheduler_output)

        monkeypatch.setattr(runner, "execute", flaky)

    return arm


@pytest.fixture(scope="module")
def interpreter():
    """Triton kernels launched while this is active run under Triton's CPU interpreter."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


@pytest.fixture
def no_warm_up(monkeypatch):
    """The model runner starts without `warm_up_triton`: warm-up launches every kernel variant, seconds under the
    interpreter, which a test of something else need not pay (test_warm_up checks warm-up itself)."""
    from tiffin.engine.worker import model_runner

    monkeypatch.setattr(model_runner, "warm_up_triton", lambda runner: None)


@pytest.fixture
def cuda_emulation(monkeypatch):
    """CUDA emulated on the CPU (`tiffin.testing.cuda_emulation`), Triton kernels under the interpreter: engines
    built with `device="cuda"` take their CUDA paths (graphs, warm-up, pinned uploads) on CPU tensors."""
    from tiffin.testing.cuda_emulation import CudaEmulation

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with CudaEmulation() as emulation:
        yield emulation


@pytest.fixture(scope="module")
def bento_server(tmp_path_factory):
    """`bento_server(target="tiffin.plugin.service:Tiffin", args=..., env=...)` -> a `BentoServer` with its BentoML
    home and log in a fresh tmp dir, returned once `ready` answers 200 (None: at once, to watch it start); every
    server it started is stopped when the module ends (a stopped one stays stopped)."""
    from pathlib import Path

    from tiffin.testing.servers import SOURCE_ROOT, TIFFIN_SERVICE, BentoServer

    started = []

    def start(
        target: str = TIFFIN_SERVICE,
        *,
        args: dict | None = None,
        env: dict | None = None,
        working_dir: Path = SOURCE_ROOT,
        ready: str | None = "/readyz",
        timeout: float = 180,
    ) -> BentoServer:
        started.append(BentoServer(tmp_path_factory.mktemp("bento"), target, args, env, working_dir))
        if ready:
            started[-1].wait(ready, 200, timeout)
        return started[-1]

    yield start
    for server in started:
        server.stop()
