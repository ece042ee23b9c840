"""The UTF-8 tables of constrained outputs against Python's own UTF-8 codec."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tiffin.engine.structured.utf8 import INVALID, START, Utf8Table, after

pytest.importorskip("xgrammar")

# bytes near the edges of table 3-7 of Unicode, so that overlong, surrogate and out-of-range encodings are drawn often
EDGES = [0x00, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC1, 0xC2, 0xDF, 0xE0, 0xE1, 0xEC, 0xED, 0xEE]
EDGES += [0xEF, 0xF0, 0xF1, 0xF3, 0xF4, 0xF5, 0xFF]
edgy_bytes = st.lists(st.sampled_from(EDGES) | st.integers(0, 255), max_size=12).map(bytes)


def _decodes(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


@given(edgy_bytes)
def test_complete_exactly_when_python_decodes(data):
    assert (after(START, data) == START) == _decodes(data)


@given(edgy_bytes)
def test_a_prefix_is_kept_exactly_when_some_valid_text_begins_with_it(data):
    """A state other than INVALID means that bytes can still complete a character: Python decodes `data`
    followed by the smallest completion of each length, or by none."""
    completions = [b""] + [bytes(c) for c in ([0x80], [0x80] * 2, [0x80] * 3, [0xA0, 0x80], [0x90, 0x80, 0x80])]
    extensible = any(_decodes(data + c) for c in completions)
    assert (after(START, data) != INVALID) == extensible


@given(st.text(max_size=20))
def test_every_text_ends_at_a_character_boundary(text):
    assert after(START, text.encode()) == START


def test_the_table_masks_tokens_by_state():
    vocab = [b"a", b"\xf0", b"\x87", b"\x90\x80\x80", b"\xc3\xa9", b"\xe4\xbd"]
    table = Utf8Table(vocab, vocab_size=len(vocab) + 3)  # ids past the tokenizer: never allowed
    after_f0 = table.next_state[START][1]
    assert [table.next_state[after_f0][t] for t in range(len(vocab))].count(INVALID) == 5  # only 90 80 80
    assert table.next_state[after_f0][3] == START
    bitmask = torch.full((2, 1), -1, dtype=torch.int32)
    table.mask(bitmask, [0, 1], [START, after_f0])
    allowed = [[t for t in range(len(vocab) + 3) if bitmask[row, 0] >> t & 1] for row in range(2)]
    assert allowed == [[0, 1, 4, 5], [3]]
