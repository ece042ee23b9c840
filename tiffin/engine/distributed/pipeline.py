"""This process's place in a pipeline: which decoder layers its stage holds and whom it passes hidden states to.

Ranks are numbered `pp_rank * tensor_parallel_size + tp_rank` (vLLM's order): a stage's tensor-parallel ranks are
contiguous, and rank 0, the engine's process, is the first stage's. Each rank of a stage sends its (replicated)
hidden states to the same tensor-parallel rank of the next stage; the last stage's rank 0 sends the logits to
rank 0, which samples."""

import dataclasses

import torch
import torch.distributed as dist


def layer_partition(num_layers: int, size: int, override: str | None = None) -> list[int]:
    """Layers per stage: `override` ("4,5,5", as vLLM's VLLM_PP_LAYER_PARTITION), else an even split whose extra
    layers go to the stages before the last, from the second-to-last back (as vLLM spreads them: the first stage
    holds the embedding, the last the norm and head). ValueError naming the numbers when a stage would hold none."""
    if override is not None:
        counts = [int(n) for n in override.split(",")]
        if len(counts) != size or sum(counts) != num_layers:
            raise ValueError(
                f"pipeline_layer_partition {override!r} must give {size} stage(s) layer counts summing to the model's "
                f"{num_layers} layers"
            )
    else:
        counts = [num_layers // size] * size
        for i in range(num_layers % size):
            counts[-2 - i] += 1
    if min(counts) < 1:
        raise ValueError(f"pipeline_parallel_size {size} leaves a stage without layers: the model has {num_layers}")
    return counts


@dataclasses.dataclass(frozen=True)
class PipelineParallel:
    """Stage `rank` of `size`, each stage `tp_size` ranks; the default is a model served whole."""

    rank: int = 0
    size: int = 1
    tp_size: int = 1
    tp_rank: int = 0
    partition: str | None = None  # the `pipeline_layer_partition` override
    batches_in_flight: int = 1  # `distributed.join.batches_in_flight`
    logits_group: object = None  # rank 0's and the last stage's first rank's group (`join.init_group`)

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    def layers(self, num_layers: int) -> range:
        """The decoder layers this stage holds."""
        counts = layer_partition(num_layers, self.size, self.partition)
        start = sum(counts[: self.rank])
        return range(start, start + counts[self.rank])

    @property
    def next_peer(self) -> int:
        """This rank's peer in the next stage, which its hidden states go to."""
        return self._peer(self.rank + 1)

    def recv_prev(self, out: torch.Tensor) -> torch.Tensor:
        """`out`, received from this rank's peer in the previous stage."""
        dist.recv(out, self._peer(self.rank - 1))
        return out

    def recv_logits(self, out: torch.Tensor) -> torch.Tensor:
        """Rank 0: `out`, a step's logits received from the last stage's rank 0."""
        dist.recv(out, self._peer(self.size - 1), group=self.logits_group)
        return out

    def _peer(self, stage: int) -> int:
        return stage * self.tp_size + self.tp_rank


UNSTAGED = PipelineParallel()
