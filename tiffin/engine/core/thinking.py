"""Where a reasoning model's sequence stands in its thinking, and the end marker its thinking budget forces.

Invariants (`ThinkingState`):
- A sequence thinks when its prompt left a thinking block open (decided once, at add_request), or when its
  output's first non-whitespace text is the start marker; it stops thinking when the end marker appears in its
  output text, or once a forced end marker is complete (whatever its text decodes to). Only a thinking or
  undecided sequence looks at its text, and only at what is new since the last token plus a marker's length.
- The thinking starts at output token 0 either way (before an output's start marker there is only whitespace);
  its budget counts from the first output token when the prompt opened it, else from the token after the start
  marker. Once `budget` tokens are spent without the end marker, the next output tokens are the end marker's
  ids, one per step: a function of the output's length alone, so preemption, n > 1 and speculation agree.
- Structured outputs apply to the answer: when the prompt opened the thinking, the grammar waits
  (`GrammarState.start` None) and starts right after the token that completes the end marker (any whitespace
  the model writes next is the grammar's to judge; text past the marker in that same token goes unchecked).
  A prompt that did not open one leaves the grammar in charge from the first token, and thinking untracked.
- Proposals (speculative decoding) never reach a forced token, nor run while a grammar waits: the rows past
  the thinking's end would be sampled unforced or unconstrained, so greedy output matches a run without them."""

from tiffin.engine.reasoning import ReasoningMarkers
from tiffin.engine.structured.backend import GrammarState


class ThinkingState:
    def __init__(
        self,
        markers: ReasoningMarkers,
        end_token_ids: list[int],
        opened: bool,
        budget: int | None,
        grammar: GrammarState | None = None,
    ):
        """`opened`: the prompt left a thinking block open (`opens_thinking`); `end_token_ids`: the end marker
        encoded alone; `grammar`: the sequence's, held back while it thinks when `opened`."""
        self.markers, self.end_token_ids, self.budget = markers, end_token_ids, budget
        self.thinking = opened
        self.decided = opened  # whether it is known that the output thinks or not
        self.budget_start = 0 if opened else None  # output token from which the budget counts
        self.answer_start: int | None = None  # output token after the end marker
        self._scan = 0  # output text offset from which the end marker may still begin
        self.grammar = grammar if opened else None  # the grammar waiting for the answer
        if self.grammar is not None:
            self.grammar.start = None

    def update(self, text: str, num_output_tokens: int) -> None:
        """After each output token: `text` is the output's text so far."""
        if self.decided and not self.thinking:
            return
        if not self.decided:
            stripped = text.lstrip()
            if len(stripped) < len(self.markers.start) and self.markers.start.startswith(stripped):
                return  # may still grow into the start marker
            self.decided, self.thinking = True, stripped.startswith(self.markers.start)
            if not self.thinking:
                return
            self.budget_start = num_output_tokens
            self._scan = len(text) - len(stripped) + len(self.markers.start)
        end = text.find(self.markers.end, self._scan)
        self._scan = max(len(text) - len(self.markers.end) + 1, self._scan)
        forced_from = self._forced_from()
        if end >= 0 or (forced_from is not None and num_output_tokens == forced_from + len(self.end_token_ids)):
            self.thinking, self.answer_start = False, num_output_tokens
            if self.grammar is not None:
                self.grammar.start = num_output_tokens

    def _forced_from(self) -> int | None:
        """The output token from which the end marker is forced (None: none is)."""
        return None if self.budget is None or not self.thinking else self.budget_start + self.budget

    def forced_token(self, num_output_tokens: int) -> int:
        """The token that output token `num_output_tokens` must be (-1: sampled freely)."""
        forced_from = self._forced_from()
        k = -1 if forced_from is None else num_output_tokens - forced_from
        return self.end_token_ids[k] if 0 <= k < len(self.end_token_ids) else -1

    def max_proposals(self, num_output_tokens: int) -> int | None:
        """How many proposals a sequence of `num_output_tokens` output tokens may verify next (None: no limit of its
        own): rows up to the one before the first forced token."""
        if self.grammar is not None and self.thinking:
            return 0
        if self.budget is None or (self.decided and not self.thinking):
            return None
        if not self.decided:  # the start marker may come in a proposal, and the budget count with it
            return 0
        return max(self._forced_from() - num_output_tokens - 1, 0)

    def num_reasoning_tokens(self, num_output_tokens: int) -> int:
        if self.answer_start is not None:
            return self.answer_start
        return num_output_tokens if self.thinking else 0
