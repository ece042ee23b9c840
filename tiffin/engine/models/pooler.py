"""Pooling models: how a sequence's hidden states become one vector (`PoolerConfig`, read from a
sentence-transformers directory or implied by the architecture), and the batched pooling itself (`Pooler`).

A pooling sequence runs its whole prompt in one step (`Scheduler`), so its hidden states are the rows
`query_start_loc[i]:query_start_loc[i+1]` of that step's forward, all of them."""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

POOLING_TYPES = ("mean", "cls", "last")
# sentence-transformers' 1_Pooling/config.json flag -> our pooling type
_ST_POOLING_MODES = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
}
_ST_SERVED_MODULES = {"Transformer", "Pooling", "Normalize"}


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str  # "mean", "cls" or "last"
    normalize: bool  # by default (a request may say otherwise)
    max_seq_length: int | None = None  # sentence-transformers' limit, when it sets one below the model's

    @classmethod
    def read(cls, path: str | Path, default_type: str, override_type: str | None = None) -> "PoolerConfig":
        """The pooling of the checkpoint at `path`: sentence-transformers' modules.json and 1_Pooling/config.json
        where present (ValueError naming a module or pooling mode tiffin does not serve), else `default_type`
        (the architecture's), normalized. `override_type` replaces the pooling type either way."""
        path = Path(path)
        modules_file = path / "modules.json"
        if not modules_file.exists():
            return cls(override_type or default_type, True)
        modules = json.loads(modules_file.read_text())
        kinds = [m["type"].rpartition(".")[2] for m in modules]
        unserved = [k for k in kinds if k not in _ST_SERVED_MODULES]
        if unserved:
            raise ValueError(
                f"{path}: sentence-transformers module {unserved[0]!r} is not served; tiffin serves "
                f"{', '.join(sorted(_ST_SERVED_MODULES))}"
            )
        pooling_type = default_type
        if "Pooling" in kinds:
            pooling = json.loads((path / modules[kinds.index("Pooling")]["path"] / "config.json").read_text())
            modes = [mode for flag, mode in _ST_POOLING_MODES.items() if pooling.get(flag)]
            others = [
                k for k, v in pooling.items() if k.startswith("pooling_mode") and v and k not in _ST_POOLING_MODES
            ]
            if len(modes) != 1 or others:
                raise ValueError(
                    f"{path}: pooling {modes + others} is not served; tiffin serves one of mean, cls, last"
                )
            pooling_type = modes[0]
        settings = path / "sentence_bert_config.json"
        max_seq_length = json.loads(settings.read_text()).get("max_seq_length") if settings.exists() else None
        return cls(override_type or pooling_type, "Normalize" in kinds, max_seq_length)


class PoolingMetadata(NamedTuple):
    """The pooling sequences of a step (S of them, R rows in all) in the flattened batch."""

    starts: torch.Tensor  # [S] int64: each one's first row
    lengths: torch.Tensor  # [S] int64: its row count
    rows: torch.Tensor  # [R] int64: their rows, sequence after sequence
    segments: torch.Tensor  # [R] int64: the sequence (0..S-1) each of `rows` belongs to

    @staticmethod
    def host_arrays(starts: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
        """The fields, in order, as int64 host arrays (the runner sends them with the step's other arrays)."""
        segments = np.repeat(np.arange(len(starts)), lengths)
        rows = starts[segments] + np.arange(len(segments)) - (np.cumsum(lengths) - lengths)[segments]
        return [a.astype(np.int64) for a in (starts, lengths, rows, segments)]


class Pooler(nn.Module):
    """hidden `[T, H]` -> one fp32 row per pooling sequence `[S, H]`, every sequence of the step at once."""

    def __init__(self, pooling_type: str):
        super().__init__()
        if pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling type {pooling_type!r} is not served; tiffin serves {', '.join(POOLING_TYPES)}")
        self.pooling_type = pooling_type

    def forward(self, hidden: torch.Tensor, md: PoolingMetadata) -> torch.Tensor:
        if self.pooling_type == "cls":
            return hidden[md.starts].float()
        if self.pooling_type == "last":
            return hidden[md.starts + md.lengths - 1].float()
        sums = torch.zeros(len(md.starts), hidden.shape[1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, md.segments, hidden[md.rows].float())
        return sums / md.lengths[:, None]
