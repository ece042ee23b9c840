import os

import pytest
import torch

torch.set_num_threads(2)
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


@pytest.fixture(scope="module")
def interpreter():
    """Triton kernels launched while this is active run under Triton's CPU interpreter."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield
