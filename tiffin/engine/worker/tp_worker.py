"""The model runner under tensor parallelism: rank 0 starts the group and sends each step; ranks 1..N-1 each run
a `ModelRunner` of their rank (their shard of the weights, their share of the KV cache) on what it receives.

A step crosses as the wire format's values: the block copies each rank runs on its KV (`KVCopies`, as two flat
lists; `ModelRunner.copy_blocks`, as rank 0 does), the size of the decode graph it replays (0: none), then for an
eager step input_ids, positions, logits indices, the LoRA slot of each token (a host tensor, so on the host at
every rank; None without adapters), the step's image embeddings (`MultiModalEmbeddings`, in the model's dtype:
rank 0 alone runs the vision tower; the rows' bits as int32, the wire carrying integers; None, None without images)
and every AttentionMetadata field, and for a graphed one the logits indices and the graph's padded inputs; the
adapters rank 0 installed this step, if any, follow as one pickled object.
Between steps a `Command` (sleep, wake, weight reload: tiffin.engine.worker.sleep) runs on every rank's runner."""

import dataclasses
import functools

import torch

from tiffin.engine.config import EngineConfig
from tiffin.engine.core.kv_offload import KVCopies
from tiffin.engine.distributed import group, multinode
from tiffin.engine.distributed.group import Command, WorkerGroup
from tiffin.engine.distributed.tensor_parallel import TensorParallel
from tiffin.engine.lora.slots import LoRASlots
from tiffin.engine.models.config import ModelConfig
from tiffin.engine.models.llava import MultiModalEmbeddings
from tiffin.engine.worker import pipeline_stage, sleep
from tiffin.engine.worker.batch import ModelInput
from tiffin.kernels import AttentionMetadata


def start(config: EngineConfig, model_config: ModelConfig, max_model_len: int, device, runner_cls) -> WorkerGroup:
    """Rank 0: refuse a model the ranks cannot share, by name, before any worker starts (the layers check again);
    then start ranks 1..N-1, each building a `runner_cls` of its rank."""
    pipeline_stage.check_supported(config, model_config)
    tp = TensorParallel(0, config.tensor_parallel_size)
    tp.split(model_config.num_heads, "num_attention_heads")
    tp.kv_heads(model_config.num_kv_heads)
    tp.split(model_config.intermediate_size, "intermediate_size")
    tp.split(model_config.vocab_size, "vocab_size")
    args = (runner_cls, config, model_config, max_model_len)
    return WorkerGroup.start(config, device, _serve_rank, args, _launcher(config))


def _launcher(config: EngineConfig):
    """How ranks 1..N-1 start: `distributed_executor_backend`'s executor."""
    if config.distributed_executor_backend == "ray":
        from tiffin.engine.distributed import ray_executor  # ray: imported only when chosen

        return ray_executor.start_workers
    if config.nnodes > 1:
        return multinode.start_workers
    return group.spawn


def run(group: WorkerGroup, inputs: ModelInput, lora_slots: LoRASlots | None, copies: KVCopies, forward):
    """Rank 0: send `inputs`, the step's block copies (each rank copies its share of the KV) and the adapters
    installed for them to the other ranks, then run `forward()`."""
    token_slots = None if inputs.lora is None else torch.from_numpy(inputs.lora.token_slots)
    attn = [getattr(inputs.attn, f.name) for f in dataclasses.fields(inputs.attn)]
    mm = [None, None] if inputs.mm is None else [inputs.mm.indices, inputs.mm.embeddings.contiguous().view(torch.int32)]
    values = [0, inputs.input_ids, inputs.positions, inputs.logits_indices, token_slots, *mm, *attn]
    return _send(group, values, lora_slots, copies, forward)


def run_graphed(
    group: WorkerGroup, size: int, padded: list, logits_indices, lora_slots: LoRASlots | None, copies, forward
):
    """Rank 0: a decode step padded to `size` (`padded`: the buffers' contents, `DecodeGraphs.padded` on the
    device) to the other ranks, which replay their graph of that size; then `forward()`."""
    return _send(group, [size, logits_indices, *padded], lora_slots, copies, forward)


def _send(group: WorkerGroup, values: list, lora_slots: LoRASlots | None, copies: KVCopies, forward):
    installs = None if lora_slots is None else lora_slots.pop_installs() or None
    offloads, loads = ([i for pair in pairs for i in pair] for pairs in (copies.offloads, copies.loads))
    return group.run([offloads, loads, *values], installs, forward)


def _serve_rank(group: WorkerGroup, runner_cls, config, model_config, max_model_len):
    """A worker's entry point: build its rank's runner (start-up errors reach rank 0), then the loop to run."""
    runner = runner_cls(config, model_config, max_model_len, set(), group)

    def serve() -> None:
        while (step := group.receive()) is not None:
            if isinstance(step, Command):
                group.answer(functools.partial(getattr(sleep, step.name), runner, *step.args))
                continue
            (offloads, loads, size, *values), installs = step
            runner.copy_blocks(KVCopies([*zip(offloads[::2], offloads[1::2])], [*zip(loads[::2], loads[1::2])]))
            if installs:
                runner.lora_slots.install(installs)
            if size:
                logits_indices, *padded = values
                runner.run_graphed(size, padded, logits_indices)
            else:
                runner.run_model(_decode(values, runner.lora_slots, model_config.dtype))

    return serve


def _decode(values: list, lora_slots: LoRASlots | None, dtype: torch.dtype) -> ModelInput:
    """An eager step's `ModelInput` from its values (`run`); the image embeddings back in the model's `dtype`."""
    input_ids, positions, logits_indices, token_slots, mm_indices, mm_bits, *attn = values
    lora = None if token_slots is None else lora_slots.metadata(token_slots.numpy())
    mm = None if mm_indices is None else MultiModalEmbeddings(mm_indices, mm_bits.view(dtype))
    return ModelInput(input_ids, positions, AttentionMetadata(*attn), logits_indices, lora, mm=mm)
