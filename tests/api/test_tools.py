"""Tool-call parsers, their grammars, and streaming that adds up to the non-streamed result."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("xgrammar")

from xgrammar.testing import _is_grammar_accept_string as accepts  # noqa: E402

from tiffin.engine.errors import ParamError  # noqa: E402
from tiffin.plugin.openai.answer import AnswerReader, AnswerStream  # noqa: E402
from tiffin.plugin.openai.structured import ResponseFormat, request_structured_outputs  # noqa: E402
from tiffin.plugin.openai.tools import (  # noqa: E402
    ChatTool,
    HermesToolParser,
    Llama3JsonToolParser,
    NamedToolChoice,
    make_parser,
    parser_for_template,
    template_messages,
)

WEATHER = ChatTool.model_validate(
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1}},
                "required": ["city"],
            },
        },
    }
)
TIME = ChatTool.model_validate({"type": "function", "function": {"name": "get_time"}})

HERMES_TEXTS = [
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", '
    '"arguments": {"city": "Rome", "days": 2}}\n</tool_call>',
    "No tools needed: 3 < 4 and <tool_ is not a tag.",
    "<tool_call>\nnot json\n</tool_call> after",
    'unfinished <tool_call>\n{"name": "get_time"',
    "",
]
LLAMA_TEXTS = [
    '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
    '<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "x"}}',
    '{"answer": 42}',
    "Plain text {not a call}",
    "  ",
]


def test_hermes_parse():
    content, calls = HermesToolParser().parse(HERMES_TEXTS[0])
    assert content == "Let me check." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    content, calls = HermesToolParser().parse(HERMES_TEXTS[1])
    assert content == "" and [c.name for c in calls] == ["get_time", "get_weather"]
    assert HermesToolParser().parse(HERMES_TEXTS[3]) == ("<tool_call>\nnot json\n</tool_call> after", [])
    assert HermesToolParser().parse(HERMES_TEXTS[4])[0] == HERMES_TEXTS[4]


def test_llama3_json_parse():
    parser = Llama3JsonToolParser()
    assert [(c.name, c.arguments) for c in parser.parse(LLAMA_TEXTS[0])[1]] == [("get_weather", '{"city": "Oslo"}')]
    content, calls = parser.parse(LLAMA_TEXTS[1])
    assert content == "" and [c.name for c in calls] == ["get_time", "get_weather"]
    assert parser.parse(LLAMA_TEXTS[2]) == ('{"answer": 42}', [])
    assert parser.parse(LLAMA_TEXTS[3]) == ("Plain text {not a call}", [])


CUT_OFF = [  # (parser, an output cut off by max_tokens in a call, the content and calls it answers)
    (HermesToolParser(), '<tool_call>\n{"name": "get_', "", []),
    (HermesToolParser(), HERMES_TEXTS[0] + '\n<tool_call>\n{"name": "get_ti', "Let me check.", ["get_weather"]),
    (HermesToolParser(), "Let me check. <tool_", "Let me check.", []),
    (Llama3JsonToolParser(), '{"name": "get_weather", "parameters": {"ci', "", []),
    (Llama3JsonToolParser(), '<|python_tag|>{"name": "get_time", "parameters": {}}; {"na', "", []),
    (Llama3JsonToolParser(), '{"answer": 4', '{"answer": 4', []),  # JSON, but no call: content
]


@pytest.mark.parametrize("parser, text, content, names", CUT_OFF)
def test_a_call_cut_off_is_dropped_streamed_or_not(parser, text, content, names):
    """A call cut off by the token limit is not answered as text (#50): whole or streamed, the answer is the
    complete calls and the content before them, the same both ways."""
    whole = AnswerReader(tool_parser=parser).read(text, cut=True)
    assert (whole.content, [c.name for c in whole.calls]) == (content, names)
    for step in (1, 4):
        stream, sent, calls = AnswerStream(AnswerReader(tool_parser=parser)), "", []
        for end in [*range(0, len(text), step), len(text)]:
            delta = stream.update(text[:end], final=end == len(text), cut=end == len(text))
            sent, calls = sent + delta.content, calls + delta.calls
        assert (sent, [c.name for c in calls]) == (content, names)


def _stream(parser, text: str, cuts: list[int]) -> tuple[str, list]:
    stream, content, calls = AnswerStream(AnswerReader(tool_parser=parser)), "", []
    for cut in [*sorted(set(cuts)), None]:
        delta = stream.update(text[:cut], final=cut is None)
        content, calls = content + delta.content, calls + delta.calls
    return content, calls


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_streamed_deltas_add_up_to_the_parse(data):
    parser = data.draw(st.sampled_from([HermesToolParser(), Llama3JsonToolParser()]))
    texts = HERMES_TEXTS if parser.name == "hermes" else LLAMA_TEXTS
    text = data.draw(st.sampled_from(texts))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    content, calls = _stream(parser, text, cuts)
    want_content, want_calls = parser.parse(text)
    assert content == want_content
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in want_calls]


@pytest.mark.parametrize("parser", [HermesToolParser(), Llama3JsonToolParser()])
def test_grammar_writes_only_calls_the_parser_reads(parser):
    grammar = parser.structural_tag([WEATHER, TIME], parallel=True).xgrammar_grammar
    one = parser.begin("get_weather") + '{"city": "Oslo", "days": 3}' + parser.end
    two = one + parser.separator + parser.begin("get_time") + "{}" + parser.end
    for text, names in ((one, ["get_weather"]), (two, ["get_weather", "get_time"])):
        assert accepts(grammar, text)
        assert [c.name for c in parser.parse(text)[1]] == names
    assert not accepts(grammar, "")  # at least one call
    assert not accepts(grammar, parser.begin("get_weather") + '{"days": 3}' + parser.end)  # city is required
    assert not accepts(grammar, parser.begin("nope") + "{}" + parser.end)
    single = parser.structural_tag([WEATHER, TIME], parallel=False).xgrammar_grammar
    assert accepts(single, one) and not accepts(single, two)


def test_parser_from_template_or_setting():
    assert parser_for_template("{% if tools %}<tool_call>{% endif %}").name == "hermes"
    assert parser_for_template("<|start_header_id|>ipython ... <|python_tag|>").name == "llama3_json"
    assert parser_for_template(None).name == "hermes"
    assert make_parser("llama3_json", "<tool_call>").name == "llama3_json"
    with pytest.raises(ValueError, match="tool_parser"):
        make_parser("pythonic", None)


def test_request_structured_outputs_sources_and_refusals():
    hermes = HermesToolParser()
    fmt = ResponseFormat.model_validate(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {}}}}
    )
    assert request_structured_outputs(fmt, None).kind == "json"
    assert request_structured_outputs(ResponseFormat(type="json_object"), None).kind == "json_object"
    assert request_structured_outputs(ResponseFormat(type="text"), None) is None
    assert request_structured_outputs(None, {"regex": "[a-z]+"}).kind == "regex"
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_time"}})
    tag = request_structured_outputs(None, None, [WEATHER, TIME], named, True, hermes)
    assert tag.kind == "structural_tag" and len(tag.structural_tag["format"]["tags"]) == 1
    assert request_structured_outputs(None, None, [WEATHER], "auto", True, hermes) is None
    bad_tool = ChatTool.model_validate(
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}
    )
    cases = [
        (dict(response_format=ResponseFormat(type="xml"), structured_outputs=None), "response_format", "unknown type"),
        (dict(response_format=ResponseFormat(type="json_schema"), structured_outputs=None), "response_format", "needs"),
        (dict(response_format=None, structured_outputs={"regex": "(", "x": 1}), "structured_outputs", "unknown field"),
        (dict(response_format=None, structured_outputs={"json": {"not": {}}}), "structured_outputs", "'not'"),
        (dict(response_format=fmt, structured_outputs={"regex": "a"}), "structured_outputs", "only one of"),
        (dict(response_format=None, structured_outputs=None, tools=[bad_tool]), "tools", "'f' parameters"),
        (dict(response_format=None, structured_outputs=None, tool_choice="required"), "tool_choice", "requires tools"),
        (
            dict(response_format=None, structured_outputs=None, tools=[WEATHER], tool_choice=named, parser=hermes),
            "tool_choice",
            "no function named",
        ),
    ]
    for kwargs, param, message in cases:
        with pytest.raises(ParamError, match=message) as e:
            request_structured_outputs(**kwargs)
        assert e.value.param == param


def test_history_arguments_become_mappings():
    messages = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}]}]
    assert template_messages(messages)[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    with pytest.raises(ValueError, match="not valid JSON"):
        template_messages([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}])


def test_deep_arguments_are_refused_and_deep_output_is_no_call():
    deep = '{"a": ' * 5000 + "1" + "}" * 5000  # past what json.loads can recurse
    for arguments in (deep, '{"a": ' * 129 + "1" + "}" * 129, '{"a": "\\ud800"}'):
        call = {"function": {"name": "f", "arguments": arguments}}
        with pytest.raises(ValueError, match=r"tool_calls\[0\]\.function\.arguments: (nests|text must be)"):
            template_messages([{"role": "assistant", "tool_calls": [call]}])
    # a model writing such JSON wrote text, not a call that no history takes back: the answer is not a failure
    for arguments in (deep, '{"a": ' * 200 + "1" + "}" * 200):
        hermes = f'<tool_call>\n{{"name": "f", "arguments": {arguments}}}\n</tool_call>'
        assert HermesToolParser().parse(hermes) == (hermes, [])
        llama = f'{{"name": "f", "parameters": {arguments}}}'
        assert Llama3JsonToolParser().parse(llama) == (llama, [])
