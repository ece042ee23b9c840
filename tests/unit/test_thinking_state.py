"""ThinkingState on scripted output text: an output that opens its own thinking (Qwen3), markers split over
tokens, the budget counted from the start marker, and the proposals it leaves room for."""

from tiffin.engine.core.thinking import ThinkingState
from tiffin.engine.reasoning import REASONING_PARSERS

MARKERS = REASONING_PARSERS["qwen3"]
END_IDS = [90, 91, 92]  # "</think>" in three tokens


def feed(state: ThinkingState, pieces: list[str]) -> list[int]:
    """Each piece one output token's text; the forced token before each."""
    text, forced = "", []
    for n, piece in enumerate(pieces):
        forced.append(state.forced_token(n))
        text += piece
        state.update(text, n + 1)
    return forced


def test_an_output_that_opens_its_thinking_counts_its_budget_from_the_start_marker():
    state = ThinkingState(MARKERS, END_IDS, opened=False, budget=2)
    forced = feed(state, ["\n", "<th", "ink>", "a", "b", "</", "thi", "nk>", "answer"])
    assert forced == [-1] * 5 + END_IDS + [-1]
    assert state.answer_start == 8 and state.num_reasoning_tokens(9) == 8


def test_the_model_closing_its_thinking_itself_ends_it_before_the_budget():
    state = ThinkingState(MARKERS, END_IDS, opened=True, budget=10)
    assert feed(state, ["x", "</thi", "nk>\n", "y"]) == [-1] * 4
    assert state.num_reasoning_tokens(4) == 3 and state.forced_token(4) == -1


def test_an_output_that_does_not_open_thinking_never_thinks():
    state = ThinkingState(MARKERS, END_IDS, opened=False, budget=0)
    assert feed(state, [" <", "b>", "</think>"]) == [-1] * 3
    assert state.num_reasoning_tokens(3) == 0 and state.max_proposals(3) is None


def test_proposals_stop_short_of_the_forced_marker():
    state = ThinkingState(MARKERS, END_IDS, opened=True, budget=6)
    assert state.max_proposals(0) == 5  # rows 0..5 all sample thinking tokens
    feed(state, ["a", "b", "c", "d"])
    assert state.max_proposals(4) == 1 and state.max_proposals(6) == 0
    undecided = ThinkingState(MARKERS, END_IDS, opened=False, budget=6)
    assert undecided.max_proposals(0) == 0  # a proposal could open the thinking and start the count
    assert ThinkingState(MARKERS, END_IDS, opened=True, budget=None).max_proposals(0) is None
