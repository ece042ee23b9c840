"""The JSON Schema `format`s that structured outputs enforce, and how.

xgrammar's own grammars for date, time and date-time let through dates that do not exist (2023-02-29,
2024-02-31, year 0000) and leap seconds, and its ipv4 grammar addresses with leading zeros (01.02.03.04), all
of which jsonschema's format checker refuses. Each of those formats is a regular language, so here it is a
pattern (`PATTERNS`) that the schema hands xgrammar instead: month lengths and leap years are spelled out. The
`XGRAMMAR_FORMATS` keep xgrammar's grammar, which produces only what the checker accepts. An optional group is
written `(X|)`: xgrammar 0.2.9 reads `(X)?` in a schema's pattern wrongly when X ends in a repetition (it lets
`([.][0-9]+)?` match "0").

Invariant: every format in `FORMATS` has a checker in jsonschema (with rfc3339-validator for the time formats),
and every string the grammar allows passes it (tests/unit/test_structured_limits.py walks the grammars at
random). A format outside `FORMATS` is refused by name (`params.unenforced_keyword`)."""

_YEAR = "(000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})"  # 0001-9999: Python's dates have no year 0
# Divisible by 4 and not by 100, or divisible by 400 (0000 is not a year).
_LEAP_YEAR = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_DATE = (
    f"({_YEAR}-(0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])"
    f"|{_YEAR}-(0[469]|11)-(0[1-9]|[12][0-9]|30)"
    f"|{_YEAR}-02-(0[1-9]|1[0-9]|2[0-8])"
    f"|{_LEAP_YEAR}-02-29)"
)
# RFC 3339's full-time, without the leap second 60 that rfc3339-validator (jsonschema's checker) refuses.
_TIME = "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]+|)(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9][0-9]|[0-9])"  # no leading zero: Python's ipaddress refuses them
_IPV4 = f"{_OCTET}(\\.{_OCTET}){{3}}"
_HEXTET = "[0-9a-fA-F]{1,4}"


def _hextets(count: int) -> str:
    return ":".join([_HEXTET] * count)


def _up_to(count: int, then: str = "") -> str:
    """0 to `count` hextets, each followed by `then` (or joined by ':' when `then` is empty)."""
    if count == 0:
        return ""
    if then:
        return f"({_HEXTET}{then}){{0,{count}}}"
    return f"({_HEXTET}(:{_HEXTET}){{0,{count - 1}}}|)"


def _ipv6() -> str:
    """RFC 4291's text forms as Python's ipaddress reads them: eight hextets, or fewer around one '::' that stands
    for at least one; the last two may be an IPv4 address."""
    forms = [f"{_hextets(7)}:{_HEXTET}", f"{_hextets(6)}:{_IPV4}"]
    forms += [f"{_hextets(left)}::{_up_to(7 - left)}" for left in range(8)]
    forms += [f"{_hextets(left)}::{_up_to(5 - left, ':')}{_IPV4}" for left in range(6)]
    return "(" + "|".join(forms) + ")"


PATTERNS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}T{_TIME}",
    "ipv4": _IPV4,
    "ipv6": _ipv6(),
}
XGRAMMAR_FORMATS = frozenset({"email", "uuid"})
FORMATS = frozenset(PATTERNS) | XGRAMMAR_FORMATS
