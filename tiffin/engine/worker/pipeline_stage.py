"""The model runner under pipeline parallelism (`distributed.pipeline`): every rank receives the step as under
tensor parallelism (`tp_worker`), then each stage runs its layers in turn: the first embeds the tokens, each stage
but the last sends its `(hidden, residual)` to the next, the last computes the logits of the sampling rows and
sends them, float32, to rank 0, which samples. No stage waits for its sends to be received, so with several
batches in flight (`tiffin.engine.pipelined`) stage 0 runs batch k+1 while the next stage runs batch k. Each
stage's KV pool holds its own layers' blocks; every rank agrees on one block count (`WorkerGroup.agree_min`).

What it does not serve yet is refused by name at start (`check_supported`). Speculative proposals that rank 0
makes itself (n-gram, suffix) are served: their verifying rows are rows of the step like any other."""

import time

import torch

from tiffin.engine.config import EngineConfig
from tiffin.engine.distributed.pipeline import PipelineParallel
from tiffin.engine.models.config import ModelConfig
from tiffin.engine.models.linear import Linear
from tiffin.engine.models.llama import LlamaForCausalLM
from tiffin.engine.models.loader import build_model
from tiffin.engine.models.registry import get_architecture
from tiffin.engine.worker.batch import ModelInput


def check_supported(config: EngineConfig, model_config: ModelConfig, device: torch.device) -> None:
    """ValueError naming what `pipeline_parallel_size` > 1 cannot serve with this model and these settings, before
    any worker starts."""
    size = config.pipeline_parallel_size
    if size == 1:
        return
    if device.type != "cpu":
        raise ValueError(f"pipeline_parallel_size {size} runs on CPU (gloo) only so far, not on {device}")
    if model_config.task != "generate":
        raise ValueError(f"pipeline_parallel_size {size} serves models that generate, not task {model_config.task!r}")
    if model_config.moe is not None:
        raise ValueError(f"pipeline_parallel_size {size} does not serve a mixture of experts yet")
    if model_config.multimodal is not None:
        raise ValueError(f"pipeline_parallel_size {size} does not serve a vision-language model yet")
    if not issubclass(get_architecture(model_config.architecture).model, LlamaForCausalLM):  # the staged model
        raise ValueError(f"pipeline_parallel_size {size} does not serve {model_config.architecture} yet")
    spec = config.speculative_config
    if spec is not None and spec.method == "draft_model":
        raise ValueError(f"pipeline_parallel_size {size} does not serve speculative decoding with a draft model yet")
    PipelineParallel(size=size, partition=config.pipeline_layer_partition).layers(model_config.num_layers)


def run_stage(runner, inputs: ModelInput) -> tuple[None, None]:
    """This stage's part of the step: its layers on what the previous stage sent, the result sent on, not waited
    for (`WorkerGroup.isend`); rank 0 takes the logits later (`receive_logits`), so that it can start the next
    batch meanwhile."""
    group, model, config = runner.group, runner.model, runner.model_config
    pp = group.pp
    received = None
    if not pp.first:
        received = pp.recv_prev((2, len(inputs.input_ids), config.hidden_size), config.dtype).unbind(0)
    start, rows = time.perf_counter(), len(inputs.logits_indices)
    out = model(inputs.input_ids, inputs.positions, inputs.attn, inputs.lora, received)
    if not pp.last:
        out = torch.stack(out).to(config.dtype)
        group.busy_s += time.perf_counter() - start
        group.isend(out, pp.next_peer)
        return None, None
    logits = model.compute_logits(out[inputs.logits_indices]) if rows else None
    group.busy_s += time.perf_counter() - start
    if logits is not None:  # the stage's tensor-parallel rank 0, which gathered them
        group.isend(logits.float(), 0)
    return None, None


def receive_logits(runner, rows: int) -> torch.Tensor | None:
    """Rank 0: the logits of a step's `rows` logits rows, from the last stage, in the order the steps were sent."""
    if not rows:
        return None
    group, start = runner.group, time.perf_counter()
    logits = group.call(lambda: group.pp.recv_logits((rows, runner.model_config.vocab_size), torch.float32))
    group.wait_s += time.perf_counter() - start
    return logits


def whole_model_layers(runner) -> dict[str, Linear]:
    """Every stage's projections, built on the meta device (their shapes, no memory): what rank 0 checks an
    adapter against, as it holds the whole adapter and sends each install to every stage, which takes its layers'
    slices."""
    config, model_config = runner.config, runner.model_config
    model = build_model(model_config, config.model, torch.device("meta"), runner.max_model_len, runner.backend)
    return {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
