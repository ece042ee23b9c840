"""Incremental detokenization with stop strings, O(new tokens) per step.

Decoding a short window of ids instead of the whole output keeps the cost per step constant (vLLM's
prefix_offset/read_offset scheme). The window holds context ids whose text was already emitted, then from
`read_offset` the unemitted ids. New text is the window's text minus the context's text, held back while it
ends in "\\ufffd" (a UTF-8 character whose bytes are split across tokens). Decoding with context also
keeps decoders that strip a leading space (SentencePiece) right mid-sequence."""

from tiffin.engine.sampling_params import SamplingParams, partial_prefix_len

_PROMPT_CONTEXT = 5  # prompt tokens decoded as context before the first output token


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        self.output_text = ""
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])  # the window; older ids are dropped
        self._read_offset = len(self._ids)
        self._max_stop_len = max(map(len, params.stop_strs), default=0)
        self.stopped: str | None = None  # the stop string matched; no text is added after it

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens; returns the stop string they complete (and cuts the text there), else None."""
        if self.stopped is not None:
            return self.stopped
        self._ids.extend(new_token_ids)
        delta = self._decode_delta()
        if not delta:
            return None
        old_len = len(self.output_text)
        self.output_text += delta
        if self._max_stop_len:
            self._check_stop(old_len)
        return self.stopped

    def stream_text(self, finished: bool) -> str:
        """Text safe to show now: while running, a tail that could still grow into a (removed) stop
        string is held back."""
        if finished or self.params.include_stop_str_in_output or not self._max_stop_len:
            return self.output_text
        text = self.output_text
        held = max((partial_prefix_len(text, s) for s in self.params.stop_strs), default=0)
        return text[: len(text) - held]

    def _decode_delta(self) -> str:
        decode = lambda ids: self.tokenizer.decode(
            ids, skip_special_tokens=self.params.skip_special_tokens, clean_up_tokenization_spaces=False
        )
        prefix_text = decode(self._ids[: self._read_offset])
        new_text = decode(self._ids)
        if new_text.endswith("\ufffd"):
            return ""  # wait for the rest of the character's bytes
        # The ids just read become the next window's context.
        self._ids = self._ids[self._read_offset :]
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def _check_stop(self, old_len: int) -> None:
        """Earliest stop string found in the new text plus len(stop)-1 chars before it."""
        text = self.output_text
        hits = [(i, s) for s in self.params.stop_strs if (i := text.find(s, max(old_len - len(s) + 1, 0))) >= 0]
        if not hits:
            return
        i, stop = min(hits, key=lambda hit: hit[0])
        self.output_text = text[: i + len(stop) if self.params.include_stop_str_in_output else i]
        self.stopped = stop
