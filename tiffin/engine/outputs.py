"""What the engine returns: vLLM's RequestOutput / CompletionOutput shapes, and its EngineStats."""

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (stop_reason says why)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, Logprob]] | None = None
    num_reasoning_tokens: int = 0  # output tokens spent thinking, markers included (the engine's reasoning_parser)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    error: str | None = None  # set when the engine failed this request (finished, others unaffected)
    # SamplingParams.prompt_logprobs: per prompt token, None for the first (no position before it)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass(frozen=True)
class EngineStats:
    """The engine's load and running totals, as of one moment (`LLMEngine.stats()`)."""

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    num_preemptions: int  # totals from here on
    prefix_cache_queries: int
    prefix_cache_hits: int
    prompt_tokens: int
    generation_tokens: int
    weight_bytes: int
    pooling_requests: int = 0  # embeddings and scores
    pooling_tokens: int = 0
    spec_drafts: int = 0  # speculative decoding: decodes that verified proposals
    spec_draft_tokens: int = 0  # proposals verified
    spec_accepted_tokens: int = 0  # proposals accepted
    spec_accepted_per_pos: tuple[int, ...] = ()  # proposals accepted by their position, 0 first: they sum to the above
    num_swapped: int = 0  # sequences preempted by swap, waiting to be swapped in
    kv_bytes_per_token: int = 0  # K and V of one token, every layer (this rank's share under tensor parallelism)
    host_kv_bytes_used: int = 0  # host memory holding KV blocks: the prefix cache's host tier and swapped sequences
    swapped_out_seqs: int = 0  # preemptions by swap (the others recompute)
    swapped_in_seqs: int = 0  # swapped sequences resumed
    host_tier_hits: int = 0  # prompt tokens loaded from the prefix cache's host tier (also in prefix_cache_hits)
    host_tier_evictions: int = 0  # blocks dropped from the host tier to make room
    prefill_tokens: int = 0  # tokens computed before each sequence's newest one: prompts and recomputes


@dataclass
class PoolingOutput:
    """A pooling request's result: the embedding (task "embed") or the classifier's scores ("classify")."""

    data: list[float]

    @property
    def embedding(self) -> list[float]:
        return self.data

    @property
    def score(self) -> float:
        """A one-label classifier's score (a reranker's relevance)."""
        return self.data[0]


@dataclass
class PoolingRequestOutput:
    """vLLM's shape: `outputs.embedding` for an embedding, `outputs.score` for a score."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput | None  # None when it failed (`error`)
    finished: bool = True
    error: str | None = None
