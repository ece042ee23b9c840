"""GPU-facing settings checked with no GPU: the dtype "auto" picks, device indices, and the Bento's resources."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tiffin.engine.config import EngineConfig
from tiffin.engine.models.config import resolve_dtype

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]


def test_auto_dtype_downcasts_fp32_only_on_cuda(monkeypatch):
    cpu, cuda1 = torch.device("cpu"), torch.device("cuda:1")
    capability = {}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability[device])
    assert resolve_dtype("auto", torch.float32, cpu) == torch.float32
    capability[cuda1] = (8, 9)
    assert resolve_dtype("auto", torch.float32, cuda1) == torch.bfloat16
    capability[cuda1] = (7, 5)  # no bf16 tensor cores before sm_80
    assert resolve_dtype("auto", torch.float32, cuda1) == torch.float16
    assert resolve_dtype("auto", torch.float16, cuda1) == torch.float16
    assert resolve_dtype("float32", torch.bfloat16, cuda1) == torch.float32  # an explicit dtype wins


def test_auto_dtype_runs_16_bit_checkpoints_in_fp32_on_a_cpu_without_their_gemm(monkeypatch):
    from tiffin.engine.models import config

    cpu = torch.device("cpu")
    monkeypatch.setattr(config, "cpu_gemm_native", lambda dtype: dtype != torch.bfloat16)  # AVX-512 FP16, no BF16
    assert resolve_dtype("auto", torch.bfloat16, cpu) == torch.float32
    assert resolve_dtype("auto", torch.float16, cpu) == torch.float16
    assert resolve_dtype("bfloat16", torch.bfloat16, cpu) == torch.bfloat16  # an explicit dtype wins
    monkeypatch.setattr(config, "cpu_gemm_native", lambda dtype: True)
    assert resolve_dtype("auto", torch.bfloat16, cpu) == torch.bfloat16
    assert config.cpu_gemm_native(torch.float32)


def test_device_index_is_kept():
    assert EngineConfig("m", device="cuda:1").torch_device == torch.device("cuda", 1)
    assert EngineConfig("m", device="cpu").torch_device == torch.device("cpu")
    for bad in ("gpu", "cuda:", "cuda:x", "mps"):
        with pytest.raises(ValueError, match="cuda:<index>"):
            EngineConfig("m", device=bad)


def _service_config(**env) -> dict:
    code = (
        "import json; from tiffin.plugin.service import Settings, Tiffin; "
        "assert 'enforce_eager' in Settings.model_fields; print(json.dumps(Tiffin.config.get('resources')))"
    )
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("TIFFIN_")}, **env}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_bento_declares_gpus_when_serving_on_cuda():
    assert _service_config() is None  # device auto, no GPU type: nothing requested (CPU serving)
    assert _service_config(TIFFIN_DEVICE="cuda") == {"gpu": 1}
    assert _service_config(TIFFIN_DEVICE="cuda:1", TIFFIN_GPU_TYPE="nvidia-l4", TIFFIN_GPUS="2") == {
        "gpu": 2,
        "gpu_type": "nvidia-l4",
    }
    # one GPU per tensor-parallel rank of each replica
    assert _service_config(TIFFIN_TENSOR_PARALLEL_SIZE="2", TIFFIN_DATA_PARALLEL_SIZE="3") == {"gpu": 6}
    assert _service_config(TIFFIN_DEVICE="cpu", TIFFIN_DATA_PARALLEL_SIZE="2") is None
