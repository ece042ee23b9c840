"""Per-request generation settings, with vLLM's names and meanings."""

import math
from dataclasses import dataclass, field


class ParamError(ValueError):
    """A request parameter that cannot be served; `param` names it as the API spells it (OpenAI's error `param`)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per generated token (plus the sampled one)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    _stop_strs: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _check(
            self.stop is None or isinstance(self.stop, (str, list, tuple)),
            "stop",
            "must be a string or a list of strings",
            self.stop,
        )
        _check(
            self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple)),
            "stop_token_ids",
            "must be a list of integers",
            self.stop_token_ids,
        )
        self._stop_strs = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        _check(_is_int(self.n) and self.n >= 1, "n", "must be an integer >= 1", self.n)
        _check(
            _is_number(self.temperature) and 0 <= self.temperature < math.inf,
            "temperature",
            "must be finite and >= 0",
            self.temperature,
        )
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k", "must be -1, 0 (off) or >= 1", self.top_k)
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, name, "must be in [-2, 2]", value)
        _check(
            _is_number(self.repetition_penalty) and 0 < self.repetition_penalty <= 2,
            "repetition_penalty",
            "must be in (0, 2]",
            self.repetition_penalty,
        )
        _check(self.seed is None or _is_int(self.seed), "seed", "must be an integer", self.seed)
        _check(
            self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
            "max_tokens",
            "must be an integer >= 1",
            self.max_tokens,
        )
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "must be >= 0", self.min_tokens)
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            "must be <= max_tokens",
            self.min_tokens,
        )
        _check(all(isinstance(s, str) and s for s in self._stop_strs), "stop", "must be non-empty strings", self.stop)
        _check(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be non-negative integers",
            self.stop_token_ids,
        )
        _check(
            self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
            "logprobs",
            "must be an integer in [0, 20]",
            self.logprobs,
        )

    @property
    def stop_strs(self) -> list[str]:
        return self._stop_strs

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(ok: bool, name: str, rule: str, value) -> None:
    if not ok:
        raise ParamError(name, f"{name} {rule}, got {value!r}")
