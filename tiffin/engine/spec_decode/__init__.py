"""Speculative decoding's proposers: cheap guesses at a decoding sequence's next tokens, which the target model
verifies in the step's one forward (core.scheduler, worker.sampler).

A proposer sets `spec_token_ids` on sequences that decode this step: at most `num_speculative_tokens` tokens,
[] for none; a proposer that draws its tokens from a distribution also sets `spec_probs`, that distribution per
token (`[len(spec_token_ids), vocab]`, on the target's device), so that verification stays lossless."""

from typing import Protocol

from tiffin.engine.config import EngineConfig
from tiffin.engine.core.sequence import Sequence
from tiffin.engine.speculative_config import SpeculativeConfig
from tiffin.engine.worker.model_runner import ModelRunner


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence]) -> None:
        """Set the proposals of `seqs`, every sequence that decodes this step and may speculate."""


def make_proposer(
    config: SpeculativeConfig, engine_config: EngineConfig, target: ModelRunner, draft: ModelRunner | None = None
) -> Proposer:
    """The proposer of `config.method` for the engine of `engine_config`, whose model `target` runs; `draft`: the
    draft model's runner for `draft_model` (`draft.load_draft`, started by `target`)."""
    if config.method == "ngram":
        from tiffin.engine.spec_decode.ngram import NgramProposer

        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        from tiffin.engine.spec_decode.suffix import SuffixProposer

        return SuffixProposer(config)
    from tiffin.engine.spec_decode.draft import DraftProposer

    return DraftProposer(config, engine_config, target, draft)
