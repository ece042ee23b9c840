"""Keeping constrained outputs valid UTF-8. xgrammar decodes multi-byte characters leniently: it takes an
overlong or surrogate encoding (`F0 87 B0 91`) as one character. With a byte-level vocabulary a sequence can
then spell bytes that the detokenizer turns into U+FFFD, and the returned text is not what the grammar matched:
a string of `maxLength` 4 came back 7 characters long. So each constrained sequence tracks where it stands
inside a UTF-8 character (`Utf8Table.next_state`), and each step masks the tokens whose bytes cannot follow
(`Utf8Table.allowed`): every constrained output is then well-formed UTF-8 (RFC 3629, table 3-7 of Unicode),
counted in the characters the grammar counted.

States: START (the next byte begins a character), else the range the next byte must fall in and how many
continuation bytes follow it."""

from collections.abc import Sequence

import numpy as np
import torch

START, INVALID = 0, 255
# state -> (lowest and highest next byte, continuation bytes left after it); state k in 1-3 is k plain
# continuation bytes left, so the state after a byte is the count it leaves (0: START)
_INSIDE = {1: (0x80, 0xBF, 0), 2: (0x80, 0xBF, 1), 3: (0x80, 0xBF, 2)}
_INSIDE |= {4: (0xA0, 0xBF, 1), 5: (0x80, 0x9F, 1), 6: (0x90, 0xBF, 2), 7: (0x80, 0x8F, 2)}  # E0, ED, F0, F4
NUM_STATES = 8


def _lead_state(byte: int) -> int:
    """The state after a character's first byte."""
    if byte < 0x80:
        return START
    if 0xC2 <= byte <= 0xDF:
        return 1
    if 0xE0 <= byte <= 0xEF:
        return {0xE0: 4, 0xED: 5}.get(byte, 2)
    if 0xF0 <= byte <= 0xF4:
        return {0xF0: 6, 0xF4: 7}.get(byte, 3)
    return INVALID  # continuation bytes, C0, C1, F5-FF never begin a character


def _byte_table() -> list[bytes]:
    """table[state][byte] -> the next state, INVALID where the byte cannot come next."""
    table = [bytearray(_lead_state(b) for b in range(256))]
    for state in range(1, NUM_STATES):
        low, high, left = _INSIDE[state]
        table.append(bytearray(left if low <= b <= high else INVALID for b in range(256)))
    return [bytes(row) for row in table]


BYTE_TABLE = _byte_table()


def after(state: int, data: bytes) -> int:
    """The state after `data` from `state`; INVALID once a byte cannot come next."""
    for byte in data:
        state = BYTE_TABLE[state][byte]
        if state == INVALID:
            break
    return state


class Utf8Table:
    """Per vocabulary: `next_state[state][token]` (INVALID where the token's bytes cannot follow `state`) and
    `allowed[state]`, the tokens that can, as an xgrammar token bitmask row (int32 words, bit i of word w is
    token 32 * w + i)."""

    def __init__(self, token_bytes: Sequence[bytes], vocab_size: int):
        table = np.full((NUM_STATES, vocab_size), INVALID, dtype=np.uint8)
        for token, data in enumerate(token_bytes[:vocab_size]):
            if data.isascii():  # most tokens: whole characters, only at a character boundary
                table[START, token] = START
            else:
                table[:, token] = [after(state, data) for state in range(NUM_STATES)]
        self.next_state = [row.tobytes() for row in table]
        words = -(-vocab_size // 32)
        bits = np.zeros((NUM_STATES, words * 32), dtype=bool)
        bits[:, :vocab_size] = table != INVALID
        self.allowed = torch.from_numpy(np.packbits(bits, axis=1, bitorder="little").view("<i4").copy())

    def mask(self, bitmask: torch.Tensor, rows: list[int], states: list[int]) -> None:
        """Clear, in place, the bits of `bitmask`'s `rows` for tokens that cannot follow each row's state."""
        bitmask[rows] &= self.allowed[states]
