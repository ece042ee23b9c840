"""The device side of multi-LoRA, owned by the ModelRunner: `LoRASlots` installs each step's adapters into a fixed
number of slots and builds the token -> slot metadata; the `LoRALayer` on each `Linear` (`linear.adapters`) adds
`B[slot] A[slot] x` after the base method ran, so it serves plain and quantized (AWQ/GPTQ) bases alike. Fused
layers keep one A block per checkpoint slice.

A slot holds a `LoRAModel` by content (its `identity`), not by id or name: an adapter removed from the engine's
registry keeps its slot until a step needs the slot for another, so requests still running finish with it.

Tensor parallelism: a slot holds this rank's part of each adapter, cut as its base layer is (a column-parallel
layer's B by output rows, a row-parallel layer's A by input columns; the row shard's delta joins its all-reduce).
Rank 0 decides the slots; the other ranks install what it sends with the step (`pop_installs` / `install`).
Pipeline parallelism: each stage's slots hold its layers' part of each adapter; rank 0 checks an adapter against
every stage's layers (`check_layers`) and keeps it whole, so each install it sends reaches every stage.

A vision-language model's adapters apply to its language model only (vLLM's rule): the vision tower and projector
(the model's `vision_modules`) hold no slots, and an adapter's modules there are ignored (`load_lora_model`).
"""

from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from tiffin.engine.lora.peft import load_lora_model
from tiffin.engine.lora.request import LoRAModel, LoRARequest
from tiffin.engine.models.linear import Linear
from tiffin.kernels.lora import LoRAMetadata, lora_apply
from tiffin.quant.base import rank_slice


class LoRALayer:
    """Device slots of one Linear's adapters: `a [S, slices*R, in]`, `b [S, R, out]` (layouts in
    tiffin.kernels.lora), in `dtype`; the delta is added to the base output in its own dtype. The stacks are
    allocated once and written in place (`set_slot`): CUDA graphs captured before any adapter loaded read them."""

    def __init__(
        self,
        linear: Linear,
        num_slots: int,
        rank: int,
        dtype: torch.dtype,
        device: torch.device,
        backend: str,
    ):
        self.a = torch.zeros(num_slots, len(linear.output_sizes) * rank, linear.input_size, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, rank, linear.output_size, dtype=dtype, device=device)
        self.rank, self.offsets, self.backend = rank, linear.offsets, backend
        self.split, self.tp, self.input_size = linear.split, linear.tp, linear.input_size
        self.filled = [False] * num_slots  # whether a slot's adapter has weights for this layer

    def __call__(self, x: torch.Tensor, y: torch.Tensor, lora: LoRAMetadata | None) -> torch.Tensor:
        """`y` (the base output of `x`) plus each token's adapter delta; `lora`: the step's token -> slot map."""
        if lora is None or not (lora.graphed or any(self.filled[: lora.num_slots])):
            return y
        x2, y2 = x.reshape(-1, x.shape[-1]).to(self.a.dtype), y.view(-1, y.shape[-1])
        lora_apply(x2, self.a, self.b, y2, self.offsets, lora, self.backend)
        return y

    def set_slot(self, slot: int, slices: list[tuple[torch.Tensor, torch.Tensor] | None] | None) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        for i, ab in enumerate(slices or []):
            if ab is not None:
                a, b = ab
                r, (lo, hi) = a.shape[0], self.offsets[i : i + 2]
                if self.split == "row":
                    a = rank_slice(a, 1, self.input_size, self.tp.rank, self.tp.size)
                elif self.split == "column":
                    b = rank_slice(b, 0, hi - lo, self.tp.rank, self.tp.size)
                self.a[slot, i * self.rank : i * self.rank + r].copy_(a)
                self.b[slot, :r, lo:hi].copy_(b.T)
        self.filled[slot] = slices is not None


class LoRASlots:
    def __init__(
        self,
        model: torch.nn.Module,
        max_loras: int,
        max_lora_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        backend: str,
        sharded: bool = False,
        check_layers: dict[str, Linear] | None = None,
    ):
        """`sharded`: other ranks install what this one does (rank 0 of a group); `check_layers`: the layers an
        adapter is checked against, if not `model`'s (a pipeline stage holds some of them)."""
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        # CPU GEMMs this small run several times faster in fp32 than in bf16/fp16: keep adapters in fp32 there
        self.dtype, self.device = torch.float32 if device.type == "cpu" else dtype, device
        self.skipped = getattr(model, "vision_prefixes", ())  # a vision-language model's tower and projector
        self.layers = language_layers(model, self.skipped)
        self.stacked_modules = dict(model.stacked_modules)
        self.prefixes = dict(getattr(model, "checkpoint_prefixes", {}))
        for linear in self.layers.values():
            linear.adapters = LoRALayer(linear, max_loras, max_lora_rank, self.dtype, device, backend)
        self.slots: list[LoRAModel | None] = [None] * max_loras
        self.slot_lru: OrderedDict[int, None] = OrderedDict.fromkeys(range(max_loras))  # least recent first
        self.sharded = sharded
        self.check_layers = self.layers if check_layers is None else language_layers(check_layers, self.skipped)
        self.installs: list[tuple[int, dict]] = []  # sharded: (slot, adapter layers) installed since last taken

    def load(self, request: LoRARequest, roots: list[Path] | None = None) -> LoRAModel:
        """Parse and check an adapter (inside `roots`, if given) against these layers, in the slots' dtype; reads
        no mutable state, so any thread may call it."""
        layers, stacked = self.check_layers, self.stacked_modules
        return load_lora_model(
            request, layers, stacked, self.max_lora_rank, self.dtype, roots, self.prefixes, self.skipped
        )

    def stage(
        self, loras: list[LoRAModel | None], num_tokens: np.ndarray, add: Callable[[np.ndarray], int]
    ) -> Callable[[Callable[[int], torch.Tensor]], LoRAMetadata] | None:
        """Install this step's adapters into slots and stage the step's token -> slot metadata with its upload
        (`LoRAMetadata.staged`); None when no request has an adapter. `loras[i]` is scheduled request i's
        adapter, which runs `num_tokens[i]` tokens."""
        seq_slots = self.assign(loras)
        return None if seq_slots is None else LoRAMetadata.staged(np.repeat(seq_slots, num_tokens), self.dtype, add)

    def assign(self, loras: list[LoRAModel | None]) -> np.ndarray | None:
        """Install the adapters of `loras` (one per scheduled request) into slots -> each request's slot (-1: the
        base model), or None when none has an adapter."""
        needed = {m.identity: m for m in loras if m is not None}
        if not needed:
            return None
        if len(needed) > self.max_loras:
            raise RuntimeError(f"a step uses {len(needed)} adapters but there are only {self.max_loras} slots")
        slot_of = {m.identity: i for i, m in enumerate(self.slots) if m is not None and m.identity in needed}
        for identity, model in needed.items():
            if identity not in slot_of:
                slot_of[identity] = self._install(model, set(slot_of.values()))
        for slot in slot_of.values():
            self.slot_lru.move_to_end(slot)
        return np.array([-1 if m is None else slot_of[m.identity] for m in loras], dtype=np.int64)

    def metadata(self, token_slots: np.ndarray) -> LoRAMetadata:
        return LoRAMetadata.build(token_slots, self.device, self.dtype)

    def pop_installs(self) -> list[tuple[int, dict]]:
        """Rank 0: the adapters installed since the last call, for the other ranks to install too."""
        installs, self.installs = self.installs, []
        return installs

    def install(self, installs: list[tuple[int, dict]]) -> None:
        """Another rank: install what rank 0 installed (`pop_installs`) into the same slots."""
        for slot, layers in installs:
            self._fill(slot, layers)

    def _install(self, model: LoRAModel, taken: set[int]) -> int:
        """Put `model` into the lowest free slot (keeping the used slot range short), else the least recently
        used slot this step does not need."""
        free = [i for i, m in enumerate(self.slots) if m is None]
        slot = free[0] if free else next(s for s in self.slot_lru if s not in taken)
        self._fill(slot, model.layers)
        if self.sharded:
            self.installs.append((slot, model.layers))
        self.slots[slot] = model
        return slot

    def _fill(self, slot: int, layers: dict) -> None:
        for name, linear in self.layers.items():
            linear.adapters.set_slot(slot, layers.get(name))


def language_layers(model: torch.nn.Module | dict[str, Linear], skipped: tuple[str, ...]) -> dict[str, Linear]:
    """The `Linear` layers of `model` (or of a name -> layer map) that adapters apply to: those whose names start
    with none of `skipped` (a vision tower's)."""
    named = model.items() if isinstance(model, dict) else model.named_modules()
    return {name: m for name, m in named if isinstance(m, Linear) and not name.startswith(skipped)}
