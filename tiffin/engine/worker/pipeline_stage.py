"""The model runner under pipeline parallelism (`distributed.pipeline`): every rank receives the step as under
tensor parallelism (`tp_worker`), then each stage runs its layers in turn: the first embeds the tokens, each stage
but the last sends its `(hidden, residual)` to the next, the last computes the logits of the sampling rows and
sends them, float32, to rank 0, which samples. No stage waits for its sends to be received, so with several
batches in flight (`tiffin.engine.pipelined`) stage 0 runs batch k+1 while the next stage runs batch k. Each
stage's KV pool holds its own layers' blocks; every rank agrees on one block count (`WorkerGroup.agree_min`).

On CUDA each stage captures its own decode graphs (`DecodeGraphs`): a later stage's take the previous stage's
`(hidden, residual)` from a buffer of theirs, which the step's receive fills in place; no send or receive is
captured. What a stage sends is a fresh tensor, never a graph's output, which the next batch's replay rewrites
while the send may still read it.

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


def check_supported(config: EngineConfig, model_config: ModelConfig) -> None:
    """ValueError naming what `pipeline_parallel_size` > 1 cannot serve with this model and these settings, before
    any worker starts."""
    size = config.pipeline_parallel_size
    if size == 1:
        return
    if model_config.task != "generate":
        raise ValueError(f"pipeline_parallel_size {size} serves models that generate, not task {model_config.task!r}")
    if model_config.moe is not None:
        raise ValueError(f"pipeline_parallel_size {size} does not serve a mixture of experts yet")
    if not issubclass(get_architecture(model_config.architecture).model, LlamaForCausalLM):  # the staged model
        raise ValueError(f"pipeline_parallel_size {size} does not serve {model_config.architecture} yet")
    spec = config.speculative_config
    if spec is not None and spec.method == "draft_model":
        raise ValueError(f"pipeline_parallel_size {size} does not serve speculative decoding with a draft model yet")
    PipelineParallel(size=size, partition=config.pipeline_layer_partition).layers(model_config.num_layers)


def run_stage(runner, inputs: ModelInput) -> tuple[None, None]:
    """This stage's part of an eager step: its layers on what the previous stage sent, the result sent on, not
    waited for (`WorkerGroup.isend`); rank 0 takes the logits later (`receive_logits`), so that it can start the next
    batch meanwhile."""
    received = None
    if not runner.pp.first:
        received = runner.pp.recv_prev(stage_input(runner, len(inputs.input_ids))).unbind(0)
    start = time.perf_counter()
    images = {} if inputs.mm is None else {"mm": inputs.mm}  # a vision-language model's: the first stage's input
    out = runner.model(inputs.input_ids, inputs.positions, inputs.attn, inputs.lora, received, **images)
    _pass_on(runner, out, inputs.logits_indices, start)
    return None, None


def run_graphed_stage(runner, size: int, logits_indices: torch.Tensor) -> None:
    """This stage's part of a decode step padded to `size`, its inputs written to the graphs' buffers already: what
    the previous stage sent received into the size's buffer, the graph replayed, the result sent on (`run_stage`)."""
    graphs = runner.decode_graphs
    if not runner.pp.first:
        runner.pp.recv_prev(graphs.stage_input(size))
    start = time.perf_counter()
    _pass_on(runner, graphs.run(size, runner.model), logits_indices, start)


def _pass_on(runner, out, logits_indices: torch.Tensor, start: float) -> None:
    """Send this stage's `out` on: a stage before the last, its `(hidden, residual)` stacked to the next stage; the
    last, the logits of `logits_indices`' rows to rank 0. `start`: when the stage's compute began (`busy_s`)."""
    group, pp, dtype = runner.group, runner.pp, runner.model_config.dtype
    if not pp.last:
        out = torch.stack(out).to(dtype)
        group.busy_s += time.perf_counter() - start
        group.isend(out, pp.next_peer)
        return
    logits = runner.model.compute_logits(out[logits_indices]) if len(logits_indices) else None
    group.busy_s += time.perf_counter() - start
    if logits is not None:  # the stage's tensor-parallel rank 0, which gathered them
        group.isend(logits.float(), 0, group=pp.logits_group)


def stage_input(runner, tokens: int) -> torch.Tensor | None:
    """Room for what the previous stage sends for `tokens` tokens, `(hidden, residual)` stacked, zeros until it
    comes (what a warm-up step runs on); None on the first stage, which embeds the tokens."""
    if runner.pp.first:
        return None
    config = runner.model_config
    return torch.zeros(2, tokens, config.hidden_size, dtype=config.dtype, device=runner.device)


def receive_logits(runner, rows: int) -> torch.Tensor | None:
    """Rank 0: the logits of a step's `rows` logits rows, from the last stage, in the order the steps were sent."""
    if not rows:
        return None
    group, start = runner.group, time.perf_counter()
    out = torch.empty(rows, runner.model_config.vocab_size, dtype=torch.float32, device=runner.device)
    logits = group.call(lambda: group.pp.recv_logits(out))
    group.wait_s += time.perf_counter() - start
    return logits


def whole_model_layers(runner) -> dict[str, Linear]:
    """Every stage's projections, built on the meta device (their shapes, no memory): what rank 0 checks an
    adapter against, as it holds the whole adapter and sends each install to every stage, which takes its layers'
    slices."""
    config, model_config = runner.config, runner.model_config
    model = build_model(model_config, config.model, torch.device("meta"), runner.max_model_len, runner.backend)
    return {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
