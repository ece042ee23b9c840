"""Per-request pooling settings, with vLLM's names: what a request that embeds or scores returns."""

from dataclasses import dataclass

from tiffin.engine.errors import ParamError
from tiffin.engine.sampling_params import _check, _is_int

POOLING_TASKS = ("embed", "classify")


@dataclass
class PoolingParams:
    """`task`: "embed" (the pooled hidden state) or "classify" (a cross-encoder's head over the pooled state: its
    labels' scores, one for a reranker). `normalize` None: as the model was trained (sentence-transformers'
    Normalize module); `dimensions`: Matryoshka truncation, renormalized when normalizing; `truncate_prompt_tokens`:
    keep this many tokens of a longer prompt (the tokenizer's truncation side, special tokens kept), -1 the model's
    limit; None refuses a prompt past the limit."""

    task: str = "embed"
    normalize: bool | None = None
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        _check(self.task in POOLING_TASKS, "task", f"must be one of {', '.join(POOLING_TASKS)}", self.task)
        _check(
            self.normalize is None or isinstance(self.normalize, bool), "normalize", "must be a boolean", self.normalize
        )
        _check(
            self.dimensions is None or (_is_int(self.dimensions) and self.dimensions >= 1),
            "dimensions",
            "must be an integer >= 1",
            self.dimensions,
        )
        if self.dimensions is not None and self.task != "embed":
            raise ParamError("dimensions", "dimensions applies to embeddings only")
        _check(
            self.truncate_prompt_tokens is None
            or (
                _is_int(self.truncate_prompt_tokens)
                and (self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1)
            ),
            "truncate_prompt_tokens",
            "must be -1 or an integer >= 1",
            self.truncate_prompt_tokens,
        )
