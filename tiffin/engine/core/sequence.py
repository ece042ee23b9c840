"""One sequence being generated: a request with n samples holds n of them."""

import itertools
from enum import Enum, auto

import torch

from tiffin.engine.core.detokenizer import IncrementalDetokenizer
from tiffin.engine.core.thinking import ThinkingState
from tiffin.engine.lora.request import LoRAModel
from tiffin.engine.multimodal.inputs import ImageInput, images_key
from tiffin.engine.outputs import Logprob
from tiffin.engine.pooling_params import PoolingParams
from tiffin.engine.sampling_params import SamplingParams
from tiffin.engine.structured.backend import GrammarState


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    SWAPPED = auto()  # preempted by swap: its computed tokens' KV in host blocks
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
        client: str | None = None,
        images: tuple[ImageInput, ...] = (),
    ):
        """`max_tokens`: params.max_tokens, or what the context leaves when that is None; `lora`: the adapter it
        runs with (None: the base model); `grammar`: its matcher when params.structured_outputs is set;
        `detokenizer`: None for sequences that need no text (profiling, scheduler tests); `pooling_params`: set for
        a sequence that pools its prompt instead of generating (`params` then goes unread).
        `client`: who sent it, for fair share (None: anonymous). `images`: its prompt's images (`multimodal.inputs`)."""
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
        # the sliding-window layers' own table and count, where they keep a pool of their own (`core.window_blocks`)
        self.window_table: list[int] = []
        self.num_window_hashed_blocks = 0
        self.swap_blocks: list[int] = []  # host blocks holding its KV while swapped out
        self.lora = lora
        self.cache_key = b"" if lora is None else lora.identity  # its blocks' prefix-cache key beside the tokens
        self.images = images
        self.grammar = grammar
        self.detokenizer = detokenizer
        self.thinking: ThinkingState | None = None  # a reasoning model's, set by the engine; read from `detokenizer`
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None  # per output token
        # per prompt token, None first (no position before it), filled as prefill chunks run; the request's first
        # sample computes them for all (`RequestOutput.prompt_logprobs`)
        asks = params.prompt_logprobs is not None and index == 0 and pooling_params is None
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = [None] if asks else None
        self.params = params
        self.priority = params.priority
        self.client = client
        self.pooling_params = pooling_params
        self.pooled: list[float] | None = None  # a pooling sequence's result
        self.max_tokens = max_tokens
        self.eos_token_ids = eos_token_ids
        self.seed = None if params.seed is None else params.seed + index
        self.spec_token_ids: list[int] = []  # proposals to verify this step (speculative decoding)
        self.spec_probs: torch.Tensor | None = None  # [len(spec_token_ids), vocab]: the draft's distributions
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

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether some prompt token still lacks its prompt logprobs (it then skips the prefix cache, `Scheduler`)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def block_key(self, start: int, end: int) -> bytes:
        """The prefix-cache key of the block over positions [start, end) beside its tokens: the adapter's identity
        and the hashes of the images it holds placeholders of."""
        return self.cache_key + images_key(self.images, start, end) if self.images else self.cache_key

    def scheduled_token_ids(self, start: int, n: int) -> list[int]:
        """The `n` tokens from position `start` on, proposals included."""
        ids = self.token_ids[start : start + n]
        return ids + self.spec_token_ids[: start + n - self.num_tokens] if self.spec_token_ids else ids

    def noise_seed(self, ahead: int = 0) -> int | None:
        """The seed of the random draws that pick output token `num_output_tokens + ahead` (None: unseeded).
        Keyed by the token's position, not by how many draws came before: a seeded sequence samples the same
        tokens whether or not proposals were verified (and rejected) on the way."""
        if self.seed is None:
            return None
        return hash((self.seed, self.num_output_tokens + ahead)) & 0x7FFF_FFFF_FFFF_FFFF

    def sampling_rows(self) -> list["Sequence | SpecRow"]:
        """Its logits rows this step: itself, or one per proposal plus the one after them."""
        if not self.spec_token_ids:
            return [self]
        return [SpecRow(self, j) for j in range(len(self.spec_token_ids) + 1)]

    ahead = 0  # as its only logits row: no proposal before it

    @property
    def proposed(self) -> int:
        """The proposal its (single) row verifies: none."""
        return -1

    @property
    def draft_probs(self) -> torch.Tensor | None:
        return None

    @property
    def forced(self) -> int:
        """The token its next output token must be, whatever is sampled (-1: none): its thinking budget's end marker."""
        return -1 if self.thinking is None else self.thinking.forced_token(self.num_output_tokens)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.detokenizer is not None:
            self.detokenizer.update([token_id])
            if self.thinking is not None:
                self.thinking.update(self.detokenizer.output_text, self.num_output_tokens)

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason, self.stop_reason = reason, stop_reason


class SpecRow:
    """Logits row `ahead` of a sequence verifying its proposals: the sequence as it stands once its first
    `ahead` proposals are accepted, verifying proposal `ahead` (none past the last: that row only samples)."""

    def __init__(self, seq: Sequence, ahead: int):
        self.seq, self.ahead = seq, ahead

    @property
    def grammar(self) -> GrammarState | None:
        return self.seq.grammar

    @property
    def params(self) -> SamplingParams:
        return self.seq.params

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seq.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.output_token_ids + self.seq.spec_token_ids[: self.ahead]

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + self.ahead

    def noise_seed(self) -> int | None:
        return self.seq.noise_seed(self.ahead)

    forced = -1  # proposals stop short of forced tokens (ThinkingState.max_proposals)

    @property
    def proposed(self) -> int:
        spec = self.seq.spec_token_ids
        return spec[self.ahead] if self.ahead < len(spec) else -1

    @property
    def draft_probs(self) -> torch.Tensor | None:
        probs = self.seq.spec_probs
        return None if probs is None or self.ahead >= len(probs) else probs[self.ahead]
