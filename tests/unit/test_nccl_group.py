"""The NCCL side of tensor parallelism, on mocked `torch.distributed` and the CUDA emulation: which GPU each rank
takes, how the process group is joined, and how a broken group is left (#25 defect 5)."""

import datetime

import pytest
import torch
import torch.distributed as dist

from tiffin.engine.config import EngineConfig
from tiffin.engine.distributed import group as group_module
from tiffin.engine.distributed import join
from tiffin.engine.distributed.group import WorkerGroup
from tiffin.engine.distributed.tensor_parallel import TensorParallel
from tiffin.testing.cuda_emulation import CudaEmulation

NCCL_ENV = ("TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


@pytest.fixture
def four_gpus(monkeypatch):
    for name in NCCL_ENV:
        monkeypatch.delenv(name, raising=False)
    with CudaEmulation(device_count=4) as emulation:
        yield emulation


def test_ranks_join_on_consecutive_gpus_from_the_configured_one(four_gpus, monkeypatch):
    """device="cuda:1" with two ranks: cuda:1 and cuda:2 (each rank used to take cuda:<rank>, putting rank 0 on
    cuda:0 beside the engine's cuda:1 tensors, or two ranks on one GPU); the communicator is bound to that GPU
    (`device_id`), and a failed collective aborts the communicators instead of NCCL's watchdog ending the process
    (eager engines also wait blocking: the collective raises in the waiting rank)."""
    import os

    joined = []
    monkeypatch.setattr(
        dist, "init_process_group", lambda backend, **kw: joined.append((backend, torch.cuda.current_device(), kw))
    )
    monkeypatch.setattr(join, "_store", lambda *args: None)  # no rendezvous: the group's join is mocked
    config, rendezvous = (
        EngineConfig("m", device="cuda:1", tensor_parallel_size=2),
        join.Rendezvous("127.0.0.1", 29500),
    )
    for rank in (0, 1):
        join.init_group(config, rank, rendezvous)
    assert [(backend, current) for backend, current, _ in joined] == [("nccl", 1), ("nccl", 2)]
    assert [kw["device_id"] for *_, kw in joined] == [torch.device("cuda", 1), torch.device("cuda", 2)]
    assert [kw["rank"] for *_, kw in joined] == [0, 1]
    # CUDA graphs (the default) capture collectives, which cannot block the host: the watchdog's abort only
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2" and "TORCH_NCCL_BLOCKING_WAIT" not in os.environ
    join.init_group(EngineConfig("m", device="cuda:1", tensor_parallel_size=2, enforce_eager=True), 0, rendezvous)
    assert os.environ["TORCH_NCCL_BLOCKING_WAIT"] == "1"
    assert [join.rank_device(config.torch_device, r) for r in (0, 1)] == [
        torch.device("cuda", 1),
        torch.device("cuda", 2),
    ]
    assert join.rank_device(torch.device("cpu"), 1) == torch.device("cpu")


def test_pipeline_ranks_join_their_groups_bounded_by_the_timeout(four_gpus, monkeypatch):
    """TP=2 x PP=2, rank 3 (stage 1's second rank) on cuda:3: each stage's tensor-parallel group, and the logits'
    own group (rank 0 and the last stage's first rank: NCCL orders a pair's messages on one stream, and the logits
    travel against the steps), every one bounded by distributed_timeout (the stages' groups had torch's default,
    30 minutes, before)."""
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: None)
    monkeypatch.setattr(join, "_store", lambda *args: None)
    made = []
    monkeypatch.setattr(dist, "new_group", lambda ranks, timeout: made.append((ranks, timeout)) or len(made))
    config = EngineConfig("m", device="cuda", tensor_parallel_size=2, pipeline_parallel_size=2, distributed_timeout=7)
    tp, pp = join.init_group(config, 3, join.Rendezvous("127.0.0.1", 29500))
    timeout = datetime.timedelta(seconds=7)
    assert made == [([0, 1], timeout), ([2, 3], timeout), ([0, 2], timeout)]
    assert (tp.rank, tp.group, pp.rank, pp.logits_group) == (1, 2, 1, 3)
    assert torch.cuda.current_device() == 3


def test_start_refuses_ranks_past_the_last_gpu(four_gpus, monkeypatch):
    monkeypatch.setattr(group_module.mp, "get_context", lambda method: pytest.fail("workers started"))
    config = EngineConfig("m", device="cuda:3", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="cuda:3 and cuda:4.*4 are visible"):
        WorkerGroup.start(config, config.torch_device, lambda group: None, ())


@pytest.mark.parametrize(
    "backend, broken, want", [("nccl", True, "abort"), ("nccl", False, "destroy"), ("gloo", True, "destroy")]
)
def test_a_broken_nccl_group_is_aborted_not_destroyed(monkeypatch, backend, broken, want):
    """destroy_process_group waits on the communicators, which hang when a peer died mid-collective: a broken
    NCCL group aborts them instead."""
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist, "destroy_process_group", lambda group=None: calls.append("destroy"))
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", lambda group=None: calls.append("abort"))
    group = WorkerGroup(TensorParallel(0, 2), torch.device("cuda", 0), 1.0, conns=[], procs=[])
    group.threads = torch.get_num_threads()
    group.broken = "tensor-parallel worker rank 1 died (exit code -9)" if broken else None
    group.shutdown()
    assert calls == [want]


def test_a_step_crosses_in_two_broadcasts_one_pinned_upload(four_gpus, monkeypatch):
    """#25 defect 7: rank 0 sends a step (lists, a host tensor, device tensors) in its two broadcasts with one
    pinned upload (before: a pageable one per list and host tensor, and the header's); a receiving rank reads
    back the header, then the lists and host tensor in one copy (before: the whole payload)."""
    sent = []
    monkeypatch.setattr(dist, "broadcast", lambda t, src: sent.append(t.clone()))
    rank0 = WorkerGroup(TensorParallel(0, 2), torch.device("cuda", 0), 1.0, conns=[], procs=[])
    values = [[1, 2], [], torch.tensor([0, -1], dtype=torch.int32), torch.arange(5, device="cuda:0"), 3, None]
    four_gpus.reset_counts()
    assert rank0.run(values, None, lambda: "forward") == "forward"
    assert len(sent) == 2 and len(four_gpus.uploads) == 1 and four_gpus.uploads[0].endswith("pinned")

    class Doorbell:
        def recv_bytes(self):
            return b"s"

    received = iter(sent)
    monkeypatch.setattr(dist, "broadcast", lambda t, src: t.copy_(next(received)))
    rank1 = WorkerGroup(TensorParallel(1, 2), torch.device("cuda", 0), 1.0, conns=[Doorbell()])
    four_gpus.reset_counts()
    got, extra = rank1.receive()
    assert four_gpus.reads == ["tolist (24, 3)", "cpu (4,)"] and four_gpus.uploads == []
    assert extra is None and got[:2] == [[1, 2], []] and got[4:] == [3, None]
    assert not got[2].is_cuda and got[2].tolist() == [0, -1] and got[3].is_cuda and got[3].tolist() == list(range(5))
