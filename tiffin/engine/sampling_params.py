"""Per-request generation settings, with vLLM's names and meanings."""

import math
from dataclasses import dataclass, field

from tiffin.engine.errors import ParamError
from tiffin.engine.structured.params import StructuredOutputsParams

INT64 = (-(2**63), 2**63 - 1)  # what torch takes for seeds and token ids
MAX_STOP = 64  # stop strings, and stop token ids: checked against every generated token
MAX_STOP_LENGTH = 1024  # characters of one stop string
MAX_LOGPROBS = 20  # top alternatives one position may list (vLLM's max_logprobs default)


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
    prompt_logprobs: int | None = None  # top-k logprobs per prompt token (plus the prompt's own), the first None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # what the output must match
    priority: int = 0  # scheduling_policy "priority": lower runs first
    # output tokens a reasoning model may think (the engine's reasoning_parser markers); past them the end-of-thinking
    # marker is forced. None: unbounded
    thinking_token_budget: int | None = None
    _stop_strs: list[str] = field(init=False, repr=False)
    stop_token_set: frozenset[int] = field(init=False, repr=False)  # built once, read every step

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
        _check(
            self.seed is None or (_is_int(self.seed) and INT64[0] <= self.seed <= INT64[1]),
            "seed",
            "must be a 64-bit integer",
            self.seed,
        )
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
        _check(
            len(self._stop_strs) <= MAX_STOP
            and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_LENGTH for s in self._stop_strs),
            "stop",
            f"must be at most {MAX_STOP} non-empty strings of at most {MAX_STOP_LENGTH} characters",
            self.stop,
        )
        _check(
            len(self.stop_token_ids) <= MAX_STOP
            and all(_is_int(t) and 0 <= t <= INT64[1] for t in self.stop_token_ids),
            "stop_token_ids",
            f"must be at most {MAX_STOP} non-negative token ids",
            self.stop_token_ids,
        )
        self.stop_token_set = frozenset(self.stop_token_ids)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS),
                name,
                f"must be an integer in [0, {MAX_LOGPROBS}] (max_logprobs)",
                value,
            )
        _check(
            self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            "must be a StructuredOutputsParams",
            self.structured_outputs,
        )
        _check(_is_int(self.priority), "priority", "must be an integer", self.priority)
        _check(
            INT64[0] <= self.priority <= INT64[1],
            "priority",
            "is out of the 64-bit integer range [-2**63, 2**63 - 1]",
            self.priority,
        )
        _check(
            self.thinking_token_budget is None
            or (_is_int(self.thinking_token_budget) and self.thinking_token_budget >= 0),
            "thinking_token_budget",
            "must be an integer >= 0",
            self.thinking_token_budget,
        )
        # The grammar decides where the output ends: min_tokens could only contradict it.
        _check(
            self.structured_outputs is None or self.min_tokens == 0,
            "min_tokens",
            "cannot be combined with structured_outputs",
            self.min_tokens,
        )

    @property
    def stop_strs(self) -> list[str]:
        return self._stop_strs

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def partial_prefix_len(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (text that may still grow
    into it)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(ok: bool, name: str, rule: str, value) -> None:
    if not ok:
        got = repr(value)  # a refused value can be megabytes long
        raise ParamError(name, f"{name} {rule}, got {got if len(got) <= 80 else got[:60] + '...'}")
