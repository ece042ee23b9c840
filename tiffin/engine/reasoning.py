"""Reasoning models' think markers: which a chat template uses, and the split of an output's text into its
reasoning and its answer.

A sequence thinks when its prompt leaves a thinking block open (DeepSeek-R1's and recent Qwen3 templates end the
generation prompt with `<think>`) or its output opens one first thing (Qwen3 writes `<think>` itself); the block
ends at the end marker. Text before the end marker is reasoning, text after it the answer.

Invariant: `split_reasoning` on a growing text with `final=False` returns a reasoning and an answer that only grow
(a tail that may still turn into a marker is held back), and with `final=True` what they grew into: streamed and
non-streamed splits agree."""

from dataclasses import dataclass

from tiffin.engine.sampling_params import partial_prefix_len


@dataclass(frozen=True)
class ReasoningMarkers:
    name: str
    start: str
    end: str


_THINK = ("<think>", "</think>")
REASONING_PARSERS = {
    name: ReasoningMarkers(name, *markers)
    for name, markers in (("deepseek_r1", _THINK), ("qwen3", _THINK), ("mistral", ("[THINK]", "[/THINK]")))
}


def resolve_reasoning_parser(setting: str | None, chat_template: str | None) -> ReasoningMarkers | None:
    """The markers of `setting` (a name in REASONING_PARSERS, "auto" or None), "auto" read from the chat template:
    the kind of markers it writes, when it writes exactly one kind."""
    if setting != "auto":
        return None if setting is None else REASONING_PARSERS[setting]
    template = chat_template or ""
    found = {m.start: m for m in REASONING_PARSERS.values() if m.start in template and m.end in template}
    return next(iter(found.values())) if len(found) == 1 else None


def opens_thinking(prompt: str, markers: ReasoningMarkers) -> bool:
    """Whether `prompt` leaves a thinking block open: its last start marker comes after its last end marker."""
    return prompt.rfind(markers.start) > prompt.rfind(markers.end)


def split_reasoning(text: str, markers: ReasoningMarkers, opened: bool, final: bool = True) -> tuple[str | None, str]:
    """(reasoning, answer) of an output's `text`; reasoning None when the output does not think. `opened`: the prompt
    left a thinking block open (`opens_thinking`). With final=False, only what more text cannot change."""
    if not opened:
        stripped = text.lstrip()
        if not stripped.startswith(markers.start):
            may_open = not final and markers.start.startswith(stripped)
            return None, "" if may_open else text
        text = stripped[len(markers.start) :]
    end = text.find(markers.end)
    if end < 0:
        held = 0 if final else partial_prefix_len(text, markers.end)
        return text[: len(text) - held], ""
    return text[:end], text[end + len(markers.end) :].lstrip()
