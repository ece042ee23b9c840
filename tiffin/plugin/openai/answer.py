"""An assistant turn's parts, read from the text a choice generated: its reasoning (between the model's think
markers, tiffin.engine.reasoning), its content, and the tool calls in the content (tiffin.plugin.openai.tools).
Every API (chat completions, Responses, Messages) reads its choices through these, streamed or not.

Invariant: the parts `AnswerStream` has sent, added up, are `parse_answer` of the final text: each part only grows
as the text grows (the split and the tool parser hold back what may still change), and a tool call is sent whole,
once it is complete."""

from dataclasses import dataclass, field

from tiffin.engine.reasoning import ReasoningMarkers, opens_thinking, split_reasoning
from tiffin.plugin.openai.tools import ToolCall, ToolParser


@dataclass
class Answer:
    reasoning: str | None  # None: the choice did not think
    content: str
    calls: list[ToolCall]


@dataclass(frozen=True)
class AnswerReader:
    """How a request's choices are read: the model's think markers (None: it does not think, all is content),
    whether the prompt left thinking open, and the tool parser (None: no tools, the content is all text)."""

    markers: ReasoningMarkers | None = None
    prompt_opens_thinking: bool = False
    tool_parser: ToolParser | None = None

    @classmethod
    def of(cls, markers: ReasoningMarkers | None, prompt: str | None, tool_parser: ToolParser | None) -> "AnswerReader":
        opened = markers is not None and prompt is not None and opens_thinking(prompt, markers)
        return cls(markers, opened, tool_parser)

    def read(self, text: str, final: bool = True, cut: bool = False) -> Answer:
        """The parts of `text` (`final`: all of it; `cut`: it ended at the token limit, so a call it was writing is
        dropped, tiffin.plugin.openai.tools)."""
        reasoning, content = (
            (None, text)
            if self.markers is None
            else split_reasoning(text, self.markers, self.prompt_opens_thinking, final)
        )
        if self.tool_parser is None:
            return Answer(reasoning, content, [])
        content, calls = self.tool_parser.parse(content, final, cut)
        return Answer(reasoning, content, calls)


@dataclass
class AnswerStream:
    """One streamed choice: what each new text adds to the parts already sent."""

    reader: AnswerReader
    reasoning_sent: int = 0
    content_sent: int = 0
    calls: list[ToolCall] = field(default_factory=list)  # sent so far

    def update(self, text: str, final: bool, cut: bool = False) -> Answer:
        """The reasoning and content added since the last update, and the calls completed since then."""
        answer = self.reader.read(text, final, cut)
        reasoning = answer.reasoning or ""
        delta = Answer(
            reasoning[self.reasoning_sent :] if answer.reasoning is not None else None,
            answer.content[self.content_sent :],
            answer.calls[len(self.calls) :],
        )
        self.reasoning_sent, self.content_sent = len(reasoning), len(answer.content)
        self.calls += delta.calls
        return delta
