"""ModelRunner's padded decode steps (`DecodeGraphs`): decode-only steps padded to a few row counts, one CUDA
graph captured per count on CUDA (the same padded inputs run eagerly elsewhere), replayed on every rank under
tensor parallelism and per stage under pipeline parallelism."""

import logging

import numpy as np
import torch

from tiffin.engine.core.scheduler import SchedulerOutput
from tiffin.engine.models.config import ModelConfig
from tiffin.engine.models.moe import MoEForCausalLM, per_expert_layers
from tiffin.engine.models.registry import get_architecture
from tiffin.engine.worker import pipeline_stage, tp_worker
from tiffin.engine.worker.batch import Upload
from tiffin.engine.worker.cuda_graphs import DecodeGraphs, decode_batch_sizes
from tiffin.kernels.mla import MAX_FP32_RANK, decodes_on_triton

logger = logging.getLogger("tiffin.graphs")


def graph_refusal(model_config: ModelConfig) -> str | None:
    """Why the model's decode steps are not captured in CUDA graphs (they run eagerly), None where they are. A
    mixture of experts' stacked experts run the fused MoE kernel, sized by the step's tokens alone, and DeepSeek's
    decode rows the Triton latent decode; what still reads device data on the host each step is refused by name."""
    arch = model_config.architecture
    if model_config.task != "generate":
        return "a pooling model runs no decode steps"
    if model_config.kv_latent_dim and not decodes_on_triton(model_config.family.kv_lora_rank, model_config.dtype):
        rank = model_config.family.kv_lora_rank
        return f"{arch}: a float32 latent of rank {rank} > {MAX_FP32_RANK} decodes by the torch plan, built on the host"
    if issubclass(get_architecture(arch).model, MoEForCausalLM) and per_expert_layers(model_config):
        return f"{arch}: GGUF experts run one expert at a time, their token counts read on the host each step"
    return None


class GraphedDecode:
    """Holds ModelRunner's `config`, `model_config`, `model`, `device`, `backend`, `group`, `pp`, `lora_slots`,
    `block_size`, `num_blocks`, `max_blocks_per_seq`, `window_group`/`window_pool` and `host_batch`."""

    def max_decode_rows(self) -> int:
        """The most rows a decode step computes and samples: a row a sequence, or with speculation one per
        proposal and one more."""
        spec = self.config.speculative_config
        return self.config.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0))

    def decode_graph_sizes(self) -> list[int]:
        """The row counts decode steps are padded to and captured at (a quantized model's stay on its fused
        GEMMs)."""
        return decode_batch_sizes(self.max_decode_rows(), self.model_config.quant_config is not None)

    def pad_decodes(self, sizes: list[int]) -> None:
        """Pad decode-only steps of up to `sizes[-1]` sequences to the next of `sizes` (`DecodeGraphs`); on
        CUDA, capture one graph per size."""
        self.decode_graphs = self.new_decode_graphs(sizes)
        if self.device.type == "cuda":
            self.decode_graphs.capture(self.model)

    def new_decode_graphs(self, sizes: list[int]) -> DecodeGraphs:
        """Buffers for decode steps padded to `sizes`, LoRA's too with adapters (whose graphed metadata only the
        Triton kernels take)."""
        if self.lora_slots is not None and self.backend != "triton":
            raise ValueError(f"padded decode steps with LoRA need the Triton kernels, not {self.backend!r}")
        max_loras = 0 if self.lora_slots is None else self.config.max_loras
        window = None if self.window_group is None else self.window_pool
        hidden = None if self.pp.first else (self.model_config.hidden_size, self.model_config.dtype)
        args = self.device, self.block_size, self.num_blocks, self.max_blocks_per_seq, max_loras, window, hidden
        return DecodeGraphs(sizes, *args)

    def graphed_step(self, scheduler_output: SchedulerOutput, upload: Upload, size: int) -> torch.Tensor | None:
        """A decode-only step (verifying ones too) padded to `size` rows, its inputs in the step's upload:
        `run_graphed` here and, under tensor parallelism, on every rank."""
        batch = self.host_batch(scheduler_output, pad=False)  # `padded` pads it to the graph's size
        loras = [s.lora for s in scheduler_output.seqs]
        seq_slots = None if self.lora_slots is None else self.lora_slots.assign(loras)
        row_slots = None if seq_slots is None else np.repeat(seq_slots, batch.query_lens)
        parts = [upload.add(a) for a in self.decode_graphs.padded(size, batch, row_slots)]
        indices = upload.add(batch.logits_indices.astype(np.int64))
        upload.send()
        padded, logits_indices = [upload.get(p) for p in parts], upload.get(indices)
        forward = lambda: self.run_graphed(size, padded, logits_indices)
        if self.group is None:
            return forward()
        copies = scheduler_output.copies
        return tp_worker.run_graphed(self.group, size, padded, logits_indices, self.lora_slots, copies, forward)

    @torch.inference_mode()
    def run_graphed(self, size: int, padded: list[torch.Tensor], logits_indices: torch.Tensor) -> torch.Tensor | None:
        """A decode step padded to `size` (`DecodeGraphs.padded`'s arrays on the device): its graph replayed, or
        its padded inputs run eagerly where none was captured; the logits as `run_model` gives them."""
        self.decode_graphs.write(padded)
        if self.pp.size > 1:
            return pipeline_stage.run_graphed_stage(self, size, logits_indices)
        hidden = self.decode_graphs.run(size, self.model)
        return self.model.compute_logits(hidden[logits_indices])
