"""A request as the engine holds it (its sequences), and the snapshots of it handed to callers."""

import time
from dataclasses import dataclass, field

from tiffin.engine.core.sequence import Sequence
from tiffin.engine.outputs import CompletionOutput, PoolingOutput, PoolingRequestOutput, RequestOutput


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    arrival_time: float = field(default_factory=time.monotonic)
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    def snapshot(self) -> RequestOutput | PoolingRequestOutput:
        """A copy, safe to hand to another thread. While a sequence runs, its text holds back a tail that may still
        become a stop string, so text streamed from successive snapshots is never taken back."""
        seq = self.seqs[0]
        if seq.pooling_params is not None:
            pooled = None if seq.pooled is None else PoolingOutput(seq.pooled)
            return PoolingRequestOutput(self.request_id, self.prompt_token_ids, pooled, seq.finished, self.error)
        outputs = [
            CompletionOutput(
                s.index,
                s.detokenizer.stream_text(s.finished),
                s.output_token_ids,
                s.finish_reason,
                s.stop_reason,
                None if s.logprobs is None else list(s.logprobs),
                0 if s.thinking is None else s.thinking.num_reasoning_tokens(s.num_output_tokens),
            )
            for s in self.seqs
        ]
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            outputs,
            self.finished,
            seq.num_cached_tokens,
            self.error,
            # the list is complete, and never changes again, once a sequence has a token
            seq.prompt_logprobs if seq.prompt_logprobs is None or seq.num_output_tokens else list(seq.prompt_logprobs),
        )


def decode_logprobs(seq: Sequence, tokenizer) -> None:
    """The text of each token in the logprobs of the step's new tokens (the prompt's, at the first token)."""
    for entries in (seq.logprobs, seq.prompt_logprobs):
        for logprobs in reversed(entries or ()):
            if logprobs is None or next(iter(logprobs.values())).decoded_token is not None:
                break
            for token_id, lp in logprobs.items():
                lp.decoded_token = tokenizer.decode([token_id])
