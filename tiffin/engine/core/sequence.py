"""One sequence being generated: a request with n samples holds n of them."""

import itertools
from enum import Enum, auto

import torch

from tiffin.engine.core.detokenizer import IncrementalDetokenizer
from tiffin.engine.lora.request import LoRAModel
from tiffin.engine.outputs import Logprob
from tiffin.engine.pooling_params import PoolingParams
from tiffin.engine.sampling_params import SamplingParams
from tiffin.engine.structured.backend import GrammarState


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """Token ids are the prompt followed by the outputs; `num_computed_tokens` of them have KV in the cache.

    A sequence whose computed tokens have caught up with all but the newest token samples next step."""

    _ids = itertools.count()

    def __init__(
        self,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        eos_token_ids: frozenset[int] = frozenset(),
        lora: LoRAModel | None = None,
        grammar: GrammarState | None = None,
        detokenizer: IncrementalDetokenizer | None = None,
        pooling_params: PoolingParams | None = None,
    ):
        """`max_tokens`: params.max_tokens, or what the context leaves when that is None; `lora`: the adapter it
        runs with (None: the base model); `grammar`: its matcher when params.structured_outputs is set;
        `detokenizer`: None for sequences that need no text (profiling, scheduler tests); `pooling_params`: set for
        a sequence that pools its prompt instead of generating (`params` then goes unread)."""
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id
        self.index = index
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache on first admission
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # hash chain of full blocks, filled by the BlockManager
        self.num_hashed_blocks = 0  # leading blocks of block_table that are in the prefix cache
        self.lora = lora
        self.cache_key = b"" if lora is None else lora.identity  # its blocks' prefix-cache key beside the tokens
        self.grammar = grammar
        self.detokenizer = detokenizer
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None  # per output token
        self.params = params
        self.pooling_params = pooling_params
        self.pooled: list[float] | None = None  # a pooling sequence's result
        self.max_tokens = max_tokens
        self.eos_token_ids = eos_token_ids
        seed = None if params.seed is None else params.seed + index
        self.generator = None if seed is None else torch.Generator().manual_seed(seed)
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.detokenizer is not None:
            self.detokenizer.update([token_id])

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason, self.stop_reason = reason, stop_reason
