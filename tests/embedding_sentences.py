"""Deterministic sentences for the embedding tests and benchmark, from a fixed word list and a seeded generator (no
network, no model): prose, unicode (accents, CJK, emoji, Arabic, mixed scripts), numbers and punctuation, repeated
words, whitespace oddities, and mixes of them, at lengths spread uniformly over a range of BERT word-pieces.

A sentence is a run of fragments, each starting with whitespace or punctuation: BERT's pre-tokenizer splits there,
so a sentence's word-pieces are the sum of its fragments' and a sentence is filled to a length fragment by
fragment. Without a tokenizer a fragment's pieces are bounded from above (`pieces_at_most`), so a sentence never
has more than its target; a unicode-heavy one may have fewer."""

import random
import re
import unicodedata
from collections.abc import Callable, Iterator

# Common English words, each one word-piece in BERT's uncased vocabulary (the MiniLM test checks it).
WORDS = """
the of and to in is was for on that with as by at from his it an were are which this be or has had not first one
their its new after but who they have her she two been other when there all during into school time may years more
most only over city some world would where later up such used many can state about national out known university
united then made north south east west people year part three high could team like group because each game series
between music american family life government history four before great district number through well law while
house called public being since work under second several both war club also season river back early area day
country including band based album old five company film them large found general best water own small main until
however age good around following late long those member system local town church common last name end center
light without against power major son way station named six took art form bridge line county little home british
among village became include near left field help place word book free winter next road half open hand set must real
student story point language health market model report summer paper science simple space study table test tree
white black green blue red young short quick brown fox jumps lazy dog sun moon star sea rain wind snow fire stone
garden kitchen bread coffee tea milk apple orange rice soup dinner morning evening night today tomorrow yesterday
""".split()

ACCENTED = (
    "café naïve résumé façade über señor crème brûlée jalapeño Zürich São Paulo Kraków smörgåsbord déjà vu".split()
)
CJK = ["机器学习", "今天天气很好", "北京", "東京", "こんにちは", "カタカナ", "안녕하세요", "서울", "漢字かな交じり文"]
EMOJI = ["🙂", "🚀", "🍜", "👍🏽", "❤️", "🇯🇵", "👩‍💻", "☕", "🎉🎉🎉", "😂"]
RTL = ["مرحبا", "السلام عليكم", "كتاب", "العربية", "شكرا جزيلا", "שלום", "עברית"]
OTHER_SCRIPTS = ["Ελληνικά", "Москва", "привет", "नमस्ते", "สวัสดี", "ქართული", "Ἀθῆναι"]
MIXED_SCRIPTS = ["café東京", "データscience", "ok👍", "Москва2026", "iPhone用", "naïveté—こころ", "α-βeta"]
UNICODE = ACCENTED + CJK + EMOJI + RTL + OTHER_SCRIPTS + MIXED_SCRIPTS
PUNCTUATION = "! ?! ... — -- ; : ( ) \" ' [...] & @ * ~ !!! ??? « » “ ” ¿ ¡ ,, .".split()
ODD_SPACES = ["  ", "\t", "\n", "\u00a0", "\u3000", "\r\n", "   \t ", "\u2003", "\n\n"]
ZERO_WIDTH = ["zero\u200bwidth", "soft\u00adhyphen", "join\u200dme", "e\u0301tude"]  # one word each, once cleaned

MAX_VARIED_PIECES = 250  # +2 special tokens: within all-MiniLM-L6-v2's 256-token max_seq_length
MISSES = 20  # fragments skipped for not fitting before a sentence stops short of its target


def pieces_at_most(fragment: str) -> int:
    """An upper bound of the BERT word-pieces (uncased, no special tokens) of `fragment`: a word of WORDS is one
    piece, anything else at most one per character once lowercased and stripped of accents, as BERT does."""
    text = "".join(c for c in unicodedata.normalize("NFD", fragment.lower()) if unicodedata.category(c) != "Mn")
    runs = re.findall(r"[a-z]+|\S", text)
    # past 100 characters, a word is one [UNK]
    return sum(1 if run in _WORD_SET or len(run) > 100 else len(run) for run in runs)


_WORD_SET = set(WORDS)


# ---- fragment streams: each fragment starts with whitespace or punctuation ----


def _word(rng: random.Random) -> str:
    """A word of prose: after a space, a comma, or a full stop (then capitalized)."""
    word, roll = rng.choice(WORDS), rng.random()
    return f". {word.capitalize()}" if roll < 0.08 else f", {word}" if roll < 0.16 else f" {word}"


def _number(rng: random.Random) -> str:
    n = rng.randrange(10 ** rng.randint(1, 7))
    return " " + rng.choice(
        [
            str(n),
            f"{n / 100:.2f}",
            f"{n:,}",
            f"${n / 100:,.2f}",
            f"-{n}",
            f"{rng.randint(1900, 2099)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
            f"{rng.randint(0, 23)}:{rng.randint(0, 59):02d}",
            f"{rng.randint(0, 100)}%",
            f"{rng.randint(1, 9)}.{rng.randint(0, 99)}e-{rng.randint(1, 12)}",
            f"v{rng.randint(0, 9)}.{rng.randint(0, 20)}.{rng.randint(0, 9)}",
            f"0x{n:X}",
            f"#{n}",
            f"+1 (555) 010-{n % 10000:04d}",
            f"{rng.randint(1, 9)}/{rng.randint(2, 16)}",
            f"{rng.randint(1, 99)}th",
            f"192.168.{rng.randint(0, 255)}.{rng.randint(0, 255)}",
        ]
    )


def _prose(rng: random.Random) -> Iterator[str]:
    while True:
        yield _word(rng)


def _unicode(rng: random.Random) -> Iterator[str]:
    while True:
        yield _word(rng) if rng.random() < 0.5 else " " + rng.choice(UNICODE)


def _numbers(rng: random.Random) -> Iterator[str]:
    while True:
        roll = rng.random()
        # punctuation sticks to the word before it, or stands alone
        yield (
            _word(rng)
            if roll < 0.4
            else _number(rng)
            if roll < 0.7
            else rng.choice(["", " "]) + rng.choice(PUNCTUATION)
        )


def _repeated(rng: random.Random) -> Iterator[str]:
    """One unit over and over, now and then glued into one long word (past 100 characters BERT makes it [UNK])."""
    unit = rng.choice([rng.choice(WORDS), "na", "ha", "lol", "very", "!", "東"])
    while True:
        yield f" {unit * rng.randint(2, 40)}" if rng.random() < 0.1 else f" {unit}"


def _whitespace(rng: random.Random) -> Iterator[str]:
    while True:
        roll = rng.random()
        yield rng.choice(ODD_SPACES) + (rng.choice(ZERO_WIDTH) if roll < 0.1 else rng.choice(WORDS))


def _mixed(rng: random.Random) -> Iterator[str]:
    streams = [_prose(rng), _unicode(rng), _numbers(rng), _whitespace(rng)]
    while True:
        yield next(rng.choice(streams))


STYLES: dict[str, Callable[[random.Random], Iterator[str]]] = {
    "prose": _prose,
    "unicode": _unicode,
    "numbers": _numbers,
    "repeated": _repeated,
    "whitespace": _whitespace,
    "mixed": _mixed,
}


def _fill(fragments: Iterator[str], budget: int, count: Callable[[str], int]) -> list[str]:
    """Fragments from the stream while their pieces fit in `budget`; one that does not fit is skipped (MISSES
    times at most), so that the sentence ends at or just under its budget."""
    taken, used, misses = [], 0, 0
    for fragment in fragments:
        pieces = count(fragment)
        if used + pieces <= budget:
            taken.append(fragment)
            used += pieces
        else:
            misses += 1
        if used == budget or misses > MISSES:
            return taken
    raise AssertionError("fragment streams are endless")


def _sentence(rng: random.Random, style: str, budget: int, count: Callable[[str], int]) -> str:
    fragments = _fill(STYLES[style](rng), budget, count)
    text = "".join(fragments).lstrip(" ,.")  # dropping the first fragment's separator only drops pieces
    if style == "whitespace":  # leading and trailing whitespace, which tokenizers drop
        text = rng.choice(ODD_SPACES) + text + rng.choice(ODD_SPACES)
    elif style in ("prose", "mixed") and text:
        end = rng.choice([".", "!", "?", ""])
        text = text[0].upper() + text[1:] + (end if count(text) < budget else "")
    return text


def _spread(rng: random.Random, n: int, low: int, high: int) -> list[int]:
    """`n` lengths evenly over [low, high], in random order."""
    lengths = [low + round(i * (high - low) / max(n - 1, 1)) for i in range(n)]
    rng.shuffle(lengths)
    return lengths


def _counter(tokenizer) -> Callable[[str], int]:
    """A fragment's word-pieces: as `tokenizer` counts them (memoized: fragments recur), else bounded."""
    if tokenizer is None:
        return pieces_at_most
    cache: dict[str, int] = {}

    def count(fragment: str) -> int:
        if fragment not in cache:
            cache[fragment] = len(tokenizer(fragment, add_special_tokens=False)["input_ids"])
        return cache[fragment]

    return count


def varied_sentences(n: int, seed: int, tokenizer=None) -> list[str]:
    """`n` sentences: the empty string, a whitespace-only one, then every style in turn at lengths spread evenly
    over 1..MAX_VARIED_PIECES word-pieces, as `tokenizer` (a Hugging Face tokenizer of a BERT-style model)
    counts them; without one, as `pieces_at_most` bounds them (unicode-heavy sentences then come out shorter)."""
    rng, count, styles = random.Random(seed), _counter(tokenizer), list(STYLES)
    edges = ["", " \t\n\u00a0"][:n]
    budgets = _spread(rng, n - len(edges), 1, MAX_VARIED_PIECES)
    return edges + [
        _sentence(rng, styles[i % len(styles)], budget, count) or rng.choice(WORDS) for i, budget in enumerate(budgets)
    ]


def benchmark_sentences(
    n: int = 1000, seed: int = 0, min_tokens: int = 8, max_tokens: int = 128, tokenizer=None
) -> list[str]:
    """`n` sentences of every style, their token counts (special tokens included: BERT's [CLS] and [SEP]) spread
    evenly over [min_tokens, max_tokens] as `tokenizer` counts them; without one, as `pieces_at_most` bounds
    them."""
    if not 3 <= min_tokens <= max_tokens:
        raise ValueError(f"need 3 <= min_tokens <= max_tokens, got {min_tokens}, {max_tokens}")
    rng, count, styles = random.Random(seed), _counter(tokenizer), list(STYLES)
    targets = _spread(rng, n, min_tokens, max_tokens)
    return [_sentence(rng, styles[i % len(styles)], t - 2, count) or "the" for i, t in enumerate(targets)]
