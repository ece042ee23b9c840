"""Block copies between the KV pool and its host blocks (the prefix cache's host tier, swap space), for
`ModelRunner`: the order each step's copies run in is stated in `core/kv_offload`, how they overlap the forward on
CUDA in `copy_blocks`."""

import torch

from tiffin.engine.core.kv_offload import KVCopies
from tiffin.kernels import kv_quant


class KVBlockCopies:
    """A mixin of `ModelRunner`: it reads the runner's `device`, `kv_spec`, `tier_spec`, `kv_tensors`,
    `host_tier`, `host_swap`, `num_host_blocks`, `copy_stream` (CUDA) and keeps its `pending_offloads`."""

    @torch.inference_mode()
    def copy_blocks(self, copies: KVCopies) -> None:
        """The step's block copies between the KV pool and the host blocks, every tensor of the pool, in the order
        `core/kv_offload` states; each batched over the step's blocks of one host region. An int8 tier for a wider
        pool (`KVCacheSpec.for_tier`) has its blocks quantized on the device (fewer bytes to the host) and
        dequantized there after the copy back. First completes the previous step's offloads (`finish_offloads`).

        On the CPU every copy is done on return. On CUDA the copies run on a side stream that first waits for the
        work queued before (the last forward wrote the blocks): an offload gathers its blocks into a fresh device
        tensor, then the loads run (a load reading a host block an offload of the step writes first has that
        offload completed, a host synchronization), then the forward's stream waits for the side stream's work so
        far; only then is an offload's device -> host copy queued (into pinned staging), which overlaps the
        forward, its scatter into the host blocks deferred to `finish_offloads` (the next step's `copy_blocks`,
        the readers of the host blocks). A load is asynchronous throughout; its host blocks are read when it is
        queued."""
        self.finish_offloads()
        if not copies:
            return
        if self.device.type != "cuda":
            self._copy(copies)
            return
        forward_stream = torch.cuda.current_stream()
        self.copy_stream.wait_stream(forward_stream)
        with torch.cuda.stream(self.copy_stream):
            self._copy(copies, forward_stream)

    def finish_offloads(self) -> None:
        """Complete the offloads queued on CUDA (`copy_blocks`): wait for each one's device -> host copy (a host
        synchronization on its event), then scatter its blocks into the host blocks. Whatever reads the host
        blocks calls it first."""
        pending, self.pending_offloads = self.pending_offloads, []
        for done, staged, host_pool, dst in pending:
            done.synchronize()
            for host, blocks in zip(_as_bytes(host_pool), staged):
                host.index_copy_(2, dst, blocks)

    def _copy(self, copies: KVCopies, forward_stream=None) -> None:
        """The copies, on CUDA on the side stream (current), which `forward_stream` waits for after the gathers
        and loads; on the CPU (`forward_stream` None) done on return."""
        tier, swap = copies.split(self.num_host_blocks[0])
        converts = self.tier_spec != self.kv_spec
        regions = ((tier, self.host_tier, converts), (swap, self.host_swap, False))
        offloads = [self._gather(r.offloads, pool, convert) for r, pool, convert in regions if r.offloads]
        reread = any({host for _, host in r.offloads} & {host for host, _ in r.loads} for r, _, _ in regions)
        if forward_stream is None or reread:  # a load reads what an offload of its step writes: that lands first
            for offload in offloads:
                self._store(*offload)
            self.finish_offloads()
            offloads = []
        for region, host_pool, convert in regions:
            if region.loads:
                self._load(region.loads, host_pool, convert)
        if forward_stream is not None:
            forward_stream.wait_event(self.copy_stream.record_event())  # the gathers and loads; not what follows
            for offload in offloads:
                self._store(*offload)

    def _gather(
        self, pairs: list[tuple[int, int]], host_pool: list[torch.Tensor], quantize: bool
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """An offload's device blocks gathered (a copy: the pool's blocks may be overwritten after it), quantized
        for an int8 tier; with its host pool and host block ids."""
        src, dst = (torch.tensor(ids) for ids in zip(*pairs))
        gathered = [kv.index_select(2, src.to(self.device)) for kv in _as_bytes(self.kv_tensors)]
        if quantize:
            gathered = kv_quant.quantize_kv(gathered[0], torch.int8)
        return gathered, host_pool, dst

    def _store(self, gathered: list[torch.Tensor], host_pool: list[torch.Tensor], dst: torch.Tensor) -> None:
        """Scatter gathered blocks into the host pool: on the CPU now; on CUDA a device -> host copy queued on the
        side stream (current) into pinned staging, its scatter pending (`finish_offloads`). The gathered tensors
        were allocated on the side stream and are used only there: freeing them after queueing is safe."""
        if self.device.type != "cuda":
            for host, g in zip(_as_bytes(host_pool), gathered):
                host.index_copy_(2, dst, g)
            return
        staged = [torch.empty(g.shape, dtype=g.dtype, pin_memory=True) for g in gathered]
        for host, g in zip(staged, gathered):
            host.copy_(g, non_blocking=True)
        self.pending_offloads.append((self.copy_stream.record_event(), staged, host_pool, dst))

    def _load(self, pairs: list[tuple[int, int]], host_pool: list[torch.Tensor], dequantize: bool) -> None:
        src, dst = (torch.tensor(ids) for ids in zip(*pairs))
        blocks = [host.index_select(2, src) for host in _as_bytes(host_pool)]
        if self.device.type == "cuda":
            blocks = [b.pin_memory().to(self.device, non_blocking=True) for b in blocks]
        if dequantize:
            blocks = [kv_quant.dequantize_kv(*blocks, self.kv_spec.dtype)]
        dst = dst.to(self.device)
        for kv, b in zip(_as_bytes(self.kv_tensors), blocks):
            kv.index_copy_(2, dst, b)


def _as_bytes(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """fp8 codes as bytes: torch has no CPU index_copy_ for float8."""
    return [t.view(torch.uint8) if t.dtype.is_floating_point and t.dtype.itemsize == 1 else t for t in tensors]
