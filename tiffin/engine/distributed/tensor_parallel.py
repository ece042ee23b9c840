"""This process's place in a tensor-parallel group: what every layer needs to size and combine its shard."""

import dataclasses

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """Rank `rank` of `size`; the default, rank 0 of 1, is a model served whole. `group`: the ranks' process group
    under pipeline parallelism (one per stage), None for all ranks."""

    rank: int = 0
    size: int = 1
    group: object = None

    def split(self, total: int, what: str) -> int:
        """This rank's share of `total` units of `what` (heads, vocabulary rows, ...); ValueError naming it."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size {self.size}")
        return total // self.size

    def kv_heads(self, total: int) -> int:
        """KV heads per rank: split, or replicated when there are fewer than ranks (MQA/GQA), so that each rank
        holds the KV heads its query heads read."""
        if total >= self.size:
            return self.split(total, "num_key_value_heads")
        if self.size % total:
            raise ValueError(f"tensor_parallel_size {self.size} is not a multiple of num_key_value_heads ({total})")
        return 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `x` concatenated along the last dim, on the group's rank 0; None on the others."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x.contiguous(), parts, group=self.group, group_dst=0)
        return torch.cat(parts, dim=-1) if self.rank == 0 else None


UNSHARDED = TensorParallel()
