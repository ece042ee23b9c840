"""Speculative decoding's settings (vLLM's `speculative_config`). Torch-free, as the engine's settings are."""

from dataclasses import dataclass

SPEC_METHODS = ("ngram", "suffix", "draft_model")


@dataclass
class SpeculativeConfig:
    """Speculative decoding, vLLM's fields: proposals verified in one forward with the step's other sequences.

    `ngram` proposes what followed the latest earlier occurrence of the sequence's last `prompt_lookup_max` down to
    `prompt_lookup_min` tokens (prompt lookup); `suffix` what most often followed the sequence's suffix in its own
    tokens and in recent requests' outputs (at most `suffix_decoding_max_cached_requests` of them, contexts up to
    `suffix_decoding_max_tree_depth` tokens, continuations at least `suffix_decoding_min_token_prob` likely, at most
    `suffix_decoding_max_spec_factor` times as many tokens as the context matched); `draft_model` what the smaller
    `model` (same tokenizer) generates in `num_speculative_tokens` steps on its own KV cache. No proposals while
    `disable_by_batch_size` or more sequences run (None: always propose); "auto": 4 on CPU, where a verifying row
    costs about a third of a decode step's compute and a few sequences already fill the cores, 64 on CUDA, where a
    decode step is bound by reading the weights."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    model: str | None = None
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 2
    disable_by_batch_size: int | str | None = "auto"
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_min_token_prob: float = 0.1
    suffix_decoding_max_spec_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config method must be one of {list(SPEC_METHODS)}, got {self.method!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config: method 'draft_model' needs a draft `model`, and only it takes one")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "suffix_decoding_max_tree_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"speculative_config {name} must be >= 1, got {getattr(self, name)}")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(
                f"speculative_config prompt_lookup_max ({self.prompt_lookup_max}) must be >= prompt_lookup_min "
                f"({self.prompt_lookup_min})"
            )
        limit = self.disable_by_batch_size
        if limit != "auto" and limit is not None and (not isinstance(limit, int) or limit < 2):
            raise ValueError(f"speculative_config disable_by_batch_size must be 'auto', None or >= 2, got {limit!r}")
        if self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("speculative_config suffix_decoding_max_cached_requests must be >= 0")
        if self.suffix_decoding_max_spec_factor <= 0:
            raise ValueError("speculative_config suffix_decoding_max_spec_factor must be > 0")
        if not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError("speculative_config suffix_decoding_min_token_prob must be in [0, 1]")
