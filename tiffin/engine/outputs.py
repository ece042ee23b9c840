"""What the engine returns: vLLM's RequestOutput / CompletionOutput shapes."""

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
