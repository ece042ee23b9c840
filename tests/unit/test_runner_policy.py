"""What a model runner does beyond prepare -> forward -> sample, as `choose_policy` decides it from the device,
dtype, backend, CPU features and settings, without building a runner."""

import pytest
import torch

from tiffin.engine.config import EngineConfig
from tiffin.engine.worker.policy import RunnerPolicy, choose_policy

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def policy(device=CPU, dtype=torch.bfloat16, backend="torch", onednn=True, native=True, **settings) -> RunnerPolicy:
    return choose_policy(device, dtype, backend, onednn, EngineConfig(model="unused", **settings), native)


def test_cpu_pads_rows_wherever_onednn_keeps_kernels_per_row_count():
    assert policy() == RunnerPolicy(
        size_threads=True,
        pad_rows=True,
        warm_up_triton=False,
        capture_graphs=False,
        int8_quantized=True,
        native_decode=True,
    )
    assert not policy(dtype=torch.float32, onednn=False).pad_rows  # MKL's sgemm keeps nothing per row count
    assert policy(dtype=torch.float32).pad_rows  # fp32 where oneDNN beats MKL
    assert policy(enable_lora=True).pad_rows  # padding rows run on the base model
    assert not policy(backend="triton").pad_rows  # the interpreter, in tests
    assert not policy(pipeline_parallel_size=2).pad_rows  # a stage's logits are its own


def test_tensor_parallel_ranks_keep_their_even_thread_split():
    assert policy().size_threads and not policy(tensor_parallel_size=2).size_threads
    assert not policy(device=CUDA, backend="triton").size_threads


@pytest.mark.parametrize(
    "settings, backend, warm, graphs",
    [
        ({}, "triton", True, True),
        ({"enforce_eager": True}, "triton", True, False),
        ({"enable_lora": True}, "triton", True, True),  # slot indices in the graphs' buffers, weights in slots
        ({"tensor_parallel_size": 2}, "triton", True, True),  # every rank captures and warms up, in step
        ({}, "torch", False, False),
    ],
)
def test_cuda_warms_up_and_captures_graphs_on_triton(settings, backend, warm, graphs):
    p = policy(device=CUDA, backend=backend, **settings)
    assert (p.warm_up_triton, p.capture_graphs, p.pad_rows) == (warm, graphs, False)


def test_quantized_layers_run_int8_on_cpu_unless_exact_asked_or_no_native_kernels():
    assert policy().int8_quantized and policy(dtype=torch.float32).int8_quantized
    assert not policy(cpu_quant_compute="exact").int8_quantized
    assert not policy(native=False).int8_quantized  # no compiler: the torch path, which is exact
    assert not policy(backend="triton").int8_quantized
    assert not policy(device=CUDA, backend="triton").int8_quantized


def test_native_decode_needs_the_int8_kernels_and_nothing_between_them():
    assert policy().native_decode
    assert not policy(cpu_quant_compute="exact").native_decode
    assert not policy(enable_lora=True).native_decode  # adapter deltas go between the kernels
    assert not policy(tensor_parallel_size=2).native_decode  # so do the all-reduces
    assert not policy(native=False).native_decode
