"""How a rank joins the group's torch.distributed process group: where the ranks meet (`Rendezvous`, rank 0's
store), which device each rank computes on, the backend (NCCL on CUDA; gloo on CPU, its connections bound to the
rank's node's address), and the rank's place in it: its tensor-parallel group and its pipeline stage, with the
groups those use. Every group is bounded by `distributed_timeout`."""

import datetime
import os
import socket
from typing import NamedTuple

import torch
import torch.distributed as dist

from tiffin.engine.distributed.pipeline import PipelineParallel
from tiffin.engine.distributed.tensor_parallel import TensorParallel


class Rendezvous(NamedTuple):
    """Where the ranks meet: rank 0's `address` and a free `port` there; `node_address`, this rank's node's, which
    its gloo connections bind (None: gloo's default, the address the hostname resolves to)."""

    address: str
    port: int
    node_address: str | None = None


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank `rank`'s device: on CUDA the rank-th GPU from the configured one (`cuda:1` with two ranks: cuda:1 and
    cuda:2), so that rank 0 computes where the engine was told to and no two ranks share a GPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def world_size(config) -> int:
    return config.tensor_parallel_size * config.pipeline_parallel_size


def batches_in_flight(config) -> int:
    """Batches the engine keeps in its pipeline at once (`pipelined`): one per stage unless set."""
    return config.pipeline_batches_in_flight or config.pipeline_parallel_size


def init_group(config, rank: int, rendezvous: Rendezvous) -> tuple[TensorParallel, PipelineParallel]:
    """Join the process group as `rank`; this rank's place in it (every rank forms every stage's group, and under
    pipeline parallelism the logits' own group: rank 0 and the last stage's first rank)."""
    device = rank_device(config.torch_device, rank)
    nccl = device.type == "cuda"
    if nccl:
        torch.cuda.set_device(device)
        # a failed or timed-out collective only aborts the communicators (by default NCCL's watchdog ends the
        # process); then the next collective raises in rank 0, which names the rank at fault (`WorkerGroup.run`)
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        if config.enforce_eager:
            # and the collective itself raises where it waits. Not with CUDA graphs: a captured collective
            # cannot block the host (the wait would query an event of the capture)
            os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
    timeout = datetime.timedelta(seconds=config.distributed_timeout)
    dist.init_process_group(
        "nccl" if nccl else _gloo(rendezvous.node_address),
        store=_store(rendezvous, rank, world_size(config), timeout),
        rank=rank,
        world_size=world_size(config),
        timeout=timeout,
        device_id=device if nccl else None,  # the communicator bound to the rank's GPU from the start
    )
    tp, stages = config.tensor_parallel_size, config.pipeline_parallel_size
    if stages == 1:
        return ranks(config, rank)
    tp_groups = [dist.new_group(list(range(s * tp, (s + 1) * tp)), timeout) for s in range(stages)] if tp > 1 else None
    # the logits travel against the steps and hidden states: NCCL orders a pair's messages on one stream, where a
    # step's send could wait on the peer's receive of it while the peer's send of earlier logits waits on ours
    logits_group = dist.new_group([0, (stages - 1) * tp], timeout)
    return ranks(config, rank, tp_groups and tp_groups[rank // tp], logits_group)


def ranks(config, rank: int, tp_group=None, logits_group=None) -> tuple[TensorParallel, PipelineParallel]:
    """Rank `rank`'s place, with the groups it uses (None: the whole group's)."""
    tp, tp_rank = config.tensor_parallel_size, rank % config.tensor_parallel_size
    partition, batches = config.pipeline_layer_partition, batches_in_flight(config)
    pp = PipelineParallel(rank // tp, config.pipeline_parallel_size, tp, tp_rank, partition, batches, logits_group)
    return TensorParallel(tp_rank, tp, tp_group), pp


def _store(rendezvous: Rendezvous, rank: int, size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """The group's rendezvous store at rank 0's address, served by rank 0 on a socket bound to that address only
    (torch's own listens on every address of the host)."""
    fd = socket.create_server((rendezvous.address, rendezvous.port)).detach() if rank == 0 else None
    return dist.TCPStore(rendezvous.address, rendezvous.port, size, rank == 0, timeout, master_listen_fd=fd)


_GLOO_BOUND = "tiffin_gloo"  # gloo bound to one address (`_gloo`), registered once per process
_bound_address: list[str] = []


def _gloo(node_address: str | None) -> str:
    """The backend that runs gloo with its connections bound to `node_address`, the rank's node's: gloo's default
    binds the address the hostname resolves to, and GLOO_SOCKET_IFNAME (obeyed when set) names only an interface,
    not one of its addresses."""
    if node_address is None or os.environ.get("GLOO_SOCKET_IFNAME"):
        return "gloo"
    if not _bound_address:
        dist.Backend.register_backend(_GLOO_BOUND, _bound_gloo, devices=["cpu"])
    _bound_address[:] = [node_address]
    return _GLOO_BOUND


def _bound_gloo(store, rank: int, size: int, timeout: datetime.timedelta) -> dist.ProcessGroupGloo:
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=_bound_address[0])]
    options._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, size, options)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
