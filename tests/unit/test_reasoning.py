"""Think markers: which a chat template uses, and the split of a text into reasoning and answer, whole or streamed
(streamed parts add up to the whole split, tool calls included)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from tiffin.engine.reasoning import REASONING_PARSERS, opens_thinking, resolve_reasoning_parser, split_reasoning
from tiffin.plugin.openai.answer import AnswerReader, AnswerStream
from tiffin.plugin.openai.tools import HermesToolParser
from tiffin.testing.thinking import THINKING_TEMPLATE
from tiffin.tiny import CHAT_TEMPLATE

R1 = REASONING_PARSERS["deepseek_r1"]
CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
TEXTS = [
    "I should add.</think>\n\nThe answer is 4.",
    "still thinking, no end",
    "<think>opened by the output</think>answer",
    "  <think>\nwith space</think>",
    "no thinking at all",
    "<thi",
    "a </think",
    "reason</think>call: " + CALL,
    "",
]


def test_markers_follow_the_template():
    assert resolve_reasoning_parser("auto", THINKING_TEMPLATE).start == "<think>"
    assert resolve_reasoning_parser("auto", CHAT_TEMPLATE) is None
    assert resolve_reasoning_parser("auto", None) is None
    assert resolve_reasoning_parser("auto", "<think></think> and [THINK][/THINK]") is None  # ambiguous
    assert resolve_reasoning_parser("mistral", CHAT_TEMPLATE).end == "[/THINK]"
    assert resolve_reasoning_parser(None, THINKING_TEMPLATE) is None


def test_split():
    assert opens_thinking("user: hi\nassistant: <think>\n", R1)
    assert not opens_thinking("assistant: <think>\n\n</think>\n\n", R1)
    assert split_reasoning(TEXTS[0], R1, opened=True) == ("I should add.", "The answer is 4.")
    assert split_reasoning(TEXTS[1], R1, opened=True) == (TEXTS[1], "")
    assert split_reasoning(TEXTS[2], R1, opened=False) == ("opened by the output", "answer")
    assert split_reasoning(TEXTS[3], R1, opened=False) == ("\nwith space", "")
    assert split_reasoning(TEXTS[4], R1, opened=False) == (None, TEXTS[4])
    assert split_reasoning("<thi", R1, opened=False, final=False) == (None, "")  # may still open
    assert split_reasoning("<thi", R1, opened=False) == (None, "<thi")
    assert split_reasoning("a </think", R1, opened=True, final=False) == ("a ", "")  # may still close


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(TEXTS), st.booleans(), st.booleans(), st.lists(st.integers(0, 80), max_size=10))
def test_streamed_parts_add_up_to_the_whole(text, opened, tools, cuts):
    reader = AnswerReader(R1, opened, HermesToolParser() if tools else None)
    stream, reasoning, content, calls = AnswerStream(reader), None, "", []
    for cut in [*sorted(c for c in set(cuts) if c <= len(text)), None]:
        delta = stream.update(text[:cut], final=cut is None)
        if delta.reasoning is not None:
            reasoning = (reasoning or "") + delta.reasoning
        content, calls = content + delta.content, calls + delta.calls
    whole = reader.read(text)
    assert (reasoning or None, content) == (whole.reasoning or None, whole.content)
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole.calls]
