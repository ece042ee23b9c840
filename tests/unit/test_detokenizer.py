import random

import pytest
from transformers import AutoTokenizer

from tiffin.engine.core.detokenizer import IncrementalDetokenizer
from tiffin.engine.sampling_params import SamplingParams
from tiffin.tiny import IM_END_ID, SPECIAL_TOKENS

TEXTS = [
    "héllo wörld 😀 日本語のテキスト, naïve café — déjà vu",
    "🎉👍🏽 family: 👨‍👩‍👧 flags 🇯🇵🇫🇷 math ∑∫√ ≠ ≈",
    "Ελληνικά и русский текст, עברית, 中文分词 and ASCII code: def f(x): return x ** 2",
    "    indented\n\ttabs\r\n  trailing spaces   \n\n",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model())


def decode(tok, ids, skip=True):
    return tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def feed(detok, ids, chunks=None, finished_at_end=True):
    """Feed ids (one at a time, or in `chunks` sizes); return the per-step output_text and stream_text."""
    texts, streams, stop, i = [], [], None, 0
    sizes = chunks or [1] * len(ids)
    for n in sizes:
        stop = detok.update(ids[i : i + n])
        i += n
        texts.append(detok.output_text)
        streams.append(detok.stream_text(finished=stop is not None))
        if stop is not None:
            break
    return texts, streams, stop


def prompt_ids(tok):
    return tok.encode("A prompt: ")  # with bos, like a real request


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any(len(decode(tokenizer, [t])) == 0 or "\ufffd" in decode(tokenizer, [t]) for t in ids) or text.isascii()
    detok = IncrementalDetokenizer(tokenizer, prompt_ids(tokenizer), SamplingParams())
    texts, _, _ = feed(detok, ids)
    assert texts[-1] == decode(tokenizer, ids) == text
    for t in texts:  # only whole characters are ever exposed, and text only grows
        assert "\ufffd" not in t and text.startswith(t)


def test_random_chunks_and_random_ids(tokenizer):
    rng = random.Random(0)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        chunks = []
        while sum(chunks) < len(ids):
            chunks.append(rng.randint(1, 4))
        detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
        assert feed(detok, ids, chunks)[0][-1] == text
    for _ in range(30):  # arbitrary ids, often invalid UTF-8: still the full decode, less a pending tail
        ids = [rng.randrange(len(SPECIAL_TOKENS), len(tokenizer)) for _ in range(rng.randint(1, 60))]
        detok = IncrementalDetokenizer(tokenizer, prompt_ids(tokenizer), SamplingParams())
        texts, _, _ = feed(detok, ids)
        full = decode(tokenizer, ids)
        assert texts[-1] == full.rstrip("\ufffd") or texts[-1] == full
        assert all(full.startswith(t) for t in texts)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer, skip):
    ids = tokenizer.encode("first turn", add_special_tokens=False) + [IM_END_ID]
    ids += tokenizer.encode("😀 after", add_special_tokens=False) + [IM_END_ID, IM_END_ID]
    detok = IncrementalDetokenizer(tokenizer, prompt_ids(tokenizer), SamplingParams(skip_special_tokens=skip))
    assert feed(detok, ids)[0][-1] == decode(tokenizer, ids, skip)
    assert ("<|im_end|>" in detok.output_text) is not skip


class CountingTokenizer:
    """Records how many ids each decode call sees."""

    def __init__(self, tok):
        self.tok, self.sizes = tok, []

    def decode(self, ids, **kw):
        self.sizes.append(len(ids))
        return self.tok.decode(ids, **kw)


def test_cost_per_step_does_not_grow(tokenizer):
    text = " ".join(TEXTS) * 20
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 1000
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting, list(range(4, 500)), SamplingParams())
    texts, _, _ = feed(detok, ids)
    assert texts[-1] == text
    assert max(counting.sizes) <= 12  # context + a few tokens of a split character, never the sequence


# ---------------------------------------------------------------- stop strings


def _token_boundaries(tok, ids) -> set[int]:
    return {len(decode(tok, ids[:i])) for i in range(len(ids) + 1)}


STOP_CASES = [
    ("The answer is 42. STOP here, then more text", "P he"),
    ("abc 😀 日本語 tail", "😀 日"),
    ("return value\n\nclass Foo:", "\n\nclass"),
    ("def main():\n    pass", "n():\n "),
]


@pytest.mark.parametrize("text, stop", STOP_CASES)
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundaries(tokenizer, text, stop, include):
    ids = tokenizer.encode(text, add_special_tokens=False)
    start = text.index(stop)
    assert any(start < b < start + len(stop) for b in _token_boundaries(tokenizer, ids))  # spans tokens
    params = SamplingParams(stop=["never", stop], include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids(tokenizer), params)
    texts, streams, matched = feed(detok, ids)
    assert matched == stop
    assert detok.output_text == text[: start + len(stop) if include else start]
    # the match happens on the first token that completes the stop string
    assert len(texts) == min(i for i in range(1, len(ids) + 1) if stop in decode(tokenizer, ids[:i]))
    assert streams[-1] == detok.output_text


def test_text_after_stop_is_dropped_and_earliest_stop_wins(tokenizer):
    text = "one two three four five"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["four", "two t"]))
    assert detok.update(ids) == "two t"  # all at once: later text must not survive
    assert detok.output_text == "one "
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop="ee f", include_stop_str_in_output=True))
    assert detok.update(ids) == "ee f" and detok.output_text == "one two three f"


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stops", [["STOPPED"], ["STOP!!", "Sto, St. X"], ["gap S", "p? Sto"], ["absent", "Stop!"]])
def test_stream_never_exposes_removed_text(tokenizer, include, stops):
    text = "Stop? Sto, St. STOP!! Stopgap STOPPED"
    ids = tokenizer.encode(text, add_special_tokens=False)
    for chunks in (None, [random.Random(len(stops)).randint(1, 3) for _ in ids]):
        detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=stops, include_stop_str_in_output=include))
        _, streams, matched = feed(detok, ids, chunks)
        assert (matched is None) == ("absent" in stops)
        final = detok.stream_text(finished=True)
        assert final == detok.output_text
        for shown in streams:  # every streamed snapshot is a prefix of the final text
            assert final.startswith(shown), (shown, final)


def test_partial_stop_held_then_released(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop="STOP"))
    detok.update(tokenizer.encode("go ST", add_special_tokens=False))
    assert detok.output_text == "go ST" and detok.stream_text(False) == "go "
    assert detok.stream_text(True) == "go ST"
    assert detok.update(tokenizer.encode("AR", add_special_tokens=False)) is None
    assert detok.stream_text(False) == "go STAR"
