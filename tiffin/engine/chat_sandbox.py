"""The sandbox chat templates render in: jinja2's immutable sandbox, as transformers builds it, with a budget of
time and size for every render.

A chat template is code from the model's files, run on every chat request. The sandbox keeps it from Python's
internals; the budget keeps it from running or growing without end, so that a hostile or careless template fails
its request fast and holds no thread:

- time: while a render runs, a trace function on its thread (that thread alone) checks the deadline at every line
  the compiled template executes, so a loop of any shape stops there and the thread is free again;
- size: what the template builds (strings, lists, numbers, its output) is charged to the render as it is built.
  Where a result's size is known beforehand (repetition and powers, formatting, joins, replacements, widths,
  JSON indents, the text of a value that is printed or concatenated), a value longer than `max_chars`, or one
  that would take the render past `BUILT_PER_CHAR` times that in all, is refused before it is built; any other
  call or filter is charged after, its result being at most a few times its inputs, which were charged already.
  So no single step runs long either.

Invariant: inside `bounded(...)` a render returns its output, raises what the template raised, or raises
`TemplateLimit` naming the setting it ran into; outside, a template renders as transformers renders it (the same
globals, filters and extensions, and the same output)."""

import functools
import re
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from itertools import repeat
from types import FrameType
from typing import Any

from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.sandbox import ImmutableSandboxedEnvironment

# what a render may build in all, per character of output it may write: templates copy each message a few times
BUILT_PER_CHAR = 8
_TEMPLATE_FILE = "<template>"  # the file name jinja2 gives the code of a template compiled from a string
_NUMBER = re.compile(r"\d+")


class TemplateLimit(BaseException):
    """A render ran into its budget. A BaseException, so that no `except Exception` on the way (jinja2's runtime, a
    filter) swallows it: Python unsets a trace function that raised, so the render must end there."""


@dataclass
class _Budget:
    deadline: float
    timeout: float
    max_chars: int
    left: int  # characters the render may still build

    def room(self, size: int) -> None:
        """Refuse a value of `size` characters (or items) before it is built."""
        if size > self.max_chars or size > self.left:
            raise TemplateLimit(
                f"the chat template built more than chat_template_max_chars allows ({self.max_chars} characters at "
                f"once, {BUILT_PER_CHAR * self.max_chars} in all)"
            )

    def charge(self, value: Any) -> Any:
        size = _size(value)
        self.room(size)
        self.left -= size
        return value

    def trace(self, frame: FrameType, event: str, arg: Any) -> Callable | None:
        """sys.settrace's hook: only the compiled template's own frames are followed line by line."""
        return self._line if frame.f_code.co_filename == _TEMPLATE_FILE else None

    def _line(self, frame: FrameType, event: str, arg: Any) -> Callable:
        if time.monotonic() > self.deadline:
            raise TemplateLimit(f"the chat template ran past chat_template_timeout ({self.timeout:g} s)")
        return self._line


_BUDGET: ContextVar[_Budget | None] = ContextVar("chat_template_budget", default=None)


@contextmanager
def bounded(timeout: float, max_chars: int) -> Iterator[None]:
    """Chat templates rendered on this thread inside the block end within `timeout` seconds and build at most
    `max_chars` characters at once (BUILT_PER_CHAR times that in all), or raise TemplateLimit."""
    install()
    budget = _Budget(time.monotonic() + timeout, timeout, max_chars, BUILT_PER_CHAR * max_chars)
    token = _BUDGET.set(budget)
    previous = sys.gettrace()  # a debugger's or coverage's, which the render suspends
    sys.settrace(budget.trace)
    try:
        yield
    finally:
        sys.settrace(previous)
        _BUDGET.reset(token)


@functools.cache
def install() -> "BoundedEnvironment":
    """Make transformers compile chat templates into the bounded sandbox, once per process; return the sandbox.
    transformers takes no environment to render in, so its compile function is replaced; apply_chat_template (its
    choice of template, the variables it passes, `sanitize_control_tokens`) stays transformers' own."""
    from transformers.utils import chat_template_utils

    original = getattr(chat_template_utils, "_compile_jinja_template", None)
    if original is None:
        raise RuntimeError("this transformers version compiles chat templates where tiffin cannot bound them")
    env = _bounded_environment(original("").environment)  # transformers' environment, for its globals and filters
    chat_template_utils._compile_jinja_template = functools.lru_cache(maxsize=128)(env.from_string)
    return env


class _CodeGenerator(CodeGenerator):
    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        """`a ~ b` converts each operand to text: through `text_of`, which sizes a value before converting it."""
        text = [nodes.Call(nodes.EnvironmentAttribute("text_of"), [n], [], None, None) for n in node.nodes]
        super().visit_Concat(nodes.Concat(text, lineno=node.lineno), frame)


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox's hooks (binary operators, calls), the output and `~` charge the current render's budget."""

    code_generator_class = _CodeGenerator
    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        budget = _BUDGET.get()
        if budget is None:
            return super().call_binop(context, operator, left, right)
        budget.room(_binop_size(operator, left, right))
        return budget.charge(super().call_binop(context, operator, left, right))

    def call(self, context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        budget = _BUDGET.get()
        if budget is None:
            return super().call(context, obj, *args, **kwargs)
        method = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format
        owner, estimate = getattr(method, "__self__", None), _STR_METHOD_SIZES.get(getattr(method, "__name__", ""))
        if isinstance(owner, str) and estimate is not None:
            if method.__name__ == "join" and args and not isinstance(args[0], (list, tuple)):
                args = (list(args[0]), *args[1:])  # its items are sized, then joined
            budget.room(estimate(owner, *args, **kwargs))
        return budget.charge(super().call(context, obj, *args, **kwargs))

    def concat(self, chunks) -> str:
        """Every output and captured block (macro, `set`, `call`, `filter`) is joined here: sized as it grows."""
        budget = _BUDGET.get()
        if budget is None:
            return "".join(chunks)
        parts, size = [], 0
        for chunk in chunks:
            size += len(chunk)
            budget.room(size)
            parts.append(chunk)
        return budget.charge("".join(parts))

    def text_of(self, value: Any) -> str:
        budget = _BUDGET.get()
        if budget is not None and not isinstance(value, str):
            budget.room(_text_size(value, budget.max_chars))
        return str(value)


def _finalize(value: Any) -> Any:
    """Every printed value passes here before it is converted to text."""
    budget = _BUDGET.get()
    if budget is not None and not isinstance(value, str):
        budget.room(_text_size(value, budget.max_chars))
    return value


def _bounded_environment(base: ImmutableSandboxedEnvironment) -> BoundedEnvironment:
    env = BoundedEnvironment(
        trim_blocks=base.trim_blocks,
        lstrip_blocks=base.lstrip_blocks,
        extensions=[type(e) for e in base.extensions.values()],
        finalize=_finalize,
    )
    env.filters.update({name: _bounded_filter(name, f) for name, f in base.filters.items()})
    env.globals.update(base.globals)
    return env


def _bounded_filter(name: str, fn: Callable) -> Callable:
    """`fn`, charging the current render; the text of its input is sized first, unless it is a structural filter
    (most filters convert their input to text)."""
    lead = 1 if getattr(fn, "jinja_pass_arg", None) is not None else 0  # a context or environment comes first

    @functools.wraps(fn)
    def bounded_filter(*args: Any, **kwargs: Any) -> Any:
        budget = _BUDGET.get()
        if budget is None or len(args) <= lead:
            return fn(*args, **kwargs)
        value, rest = args[lead], args[lead + 1 :]
        if name in ("join", "sum") and not isinstance(value, (str, list, tuple, dict)):
            value = list(value)  # its items are sized, then used
        if name not in _STRUCTURAL_FILTERS:
            budget.room(_text_size(value, budget.max_chars))
        if name in _FILTER_SIZES:
            budget.room(_FILTER_SIZES[name](value, *rest, **kwargs))
        return budget.charge(fn(*args[:lead], value, *rest, **kwargs))

    return bounded_filter


def _size(value: Any) -> int:
    if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)):
        return len(value)
    if isinstance(value, int):
        return value.bit_length() // 3  # about its decimal digits
    return 0


def _is_int(value: Any) -> bool:
    return isinstance(value, int)


def _is_sized(value: Any) -> bool:
    return isinstance(value, (str, list, tuple))


def _text_size(value: Any, cap: int, indent: int = 0) -> int:
    """About how long `value`'s text (str() or JSON, with `indent` per nesting level) is, without building it: its
    strings' lengths and a few characters per item; counting stops past `cap`."""
    size, stack = 0, [(value, 0)]
    while stack and size <= cap:
        item, depth = stack.pop()
        size += 2 + indent * depth
        if isinstance(item, str):
            size += len(item)
        elif isinstance(item, dict):
            stack += [(x, depth + 1) for pair in item.items() for x in pair]
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack += [(x, depth + 1) for x in item]
        else:
            size += _size(item)
    return size


def _binop_size(operator: str, left: Any, right: Any) -> int:
    if operator == "*":
        if _is_int(right) and _is_sized(left):
            return len(left) * right
        if _is_int(left) and _is_sized(right):
            return len(right) * left
        if _is_int(left) and _is_int(right):
            return (left.bit_length() + right.bit_length()) // 3
    elif operator == "**" and _is_int(left) and _is_int(right) and right > 0:
        return right * left.bit_length() // 3
    elif operator == "+" and _is_sized(left) and _is_sized(right):
        return len(left) + len(right)
    elif operator == "%" and isinstance(left, str):
        values = right.values() if isinstance(right, dict) else right if isinstance(right, tuple) else (right,)
        return _format_size(left, list(values))
    return 0


def _format_size(fmt: str, values: list) -> int:
    """At most: the format's own text, and per field the widest width it names and the longest value (a field may
    name a value twice; `*` and nested fields take their width from an integer value)."""
    widths = [int(n) for n in _NUMBER.findall(fmt)]
    if "*" in fmt or re.search(r"\{[^{}]*\{", fmt):
        widths += [v for v in values if _is_int(v)]
    longest = max((_text_size(v, sys.maxsize) for v in values), default=0)
    return len(fmt) + (fmt.count("%") + fmt.count("{")) * (max(widths, default=0) + longest)


def _join_size(items: Any, separator: Any = "", *_: Any, **__: Any) -> int:
    """The joined text's length, counted only until it passes the render's `max_chars`."""
    budget = _BUDGET.get()
    cap = budget.max_chars if budget is not None else sys.maxsize
    size = len(str(separator)) * (len(items) if isinstance(items, (str, list, tuple, dict)) else 0)
    for item in items:
        if size > cap:
            break
        size += _text_size(item, cap)
    return size


def _replace_size(s: str, old: str, new: str, count: int | None = -1, *_: Any) -> int:
    times = s.count(old) if old else len(s) + 1
    if count is not None and count >= 0:
        times = min(times, count)
    return len(s) + times * max(len(new) - len(old), 0)


def _indent_size(s: Any, width: int | str = 4, *_: Any, **__: Any) -> int:
    text = str(s)
    return len(text) + (text.count("\n") + 1) * (width if _is_int(width) else len(str(width)))


def _json_size(value: Any, ensure_ascii: bool = False, indent: int | str | None = None, *_: Any, **__: Any) -> int:
    width = indent if _is_int(indent) else len(indent or "")
    return 2 * _text_size(value, sys.maxsize, width)  # quotes and escapes, about


def _values(table: Any) -> Any:
    """What a str.translate table maps characters to."""
    return table.values() if isinstance(table, dict) else table


def _sum_size(items: Any, attribute: Any = None, start: Any = 0) -> int:
    return _size(start) + sum(_size(x) for x in items)


# filters that never convert their input to text: sizing its text first would refuse long lists for nothing
_STRUCTURAL_FILTERS = frozenset(
    {"attr", "batch", "count", "d", "default", "dictsort", "first", "groupby", "items", "join", "last", "length"}
    | {"list", "map", "max", "min", "random", "reject", "rejectattr", "reverse", "select", "selectattr", "slice"}
    | {"sort", "sum", "tojson", "unique"}
)
# how long a call's result may be, from its arguments; for the str methods and filters that multiply their inputs
_STR_METHOD_SIZES: dict[str, Callable[..., int]] = {
    "join": lambda s, items: _join_size(items, s),
    "replace": _replace_size,
    "expandtabs": lambda s, tabsize=8: len(s) + s.count("\t") * tabsize,
    "center": lambda s, width, *_: max(len(s), width),
    "ljust": lambda s, width, *_: max(len(s), width),
    "rjust": lambda s, width, *_: max(len(s), width),
    "zfill": lambda s, width: max(len(s), width),
    "format": lambda s, *args, **kwargs: _format_size(s, [*args, *kwargs.values()]),
    "format_map": lambda s, mapping: _format_size(s, list(mapping.values())),
    "translate": lambda s, table: len(s) * max(map(_text_size, _values(table), repeat(sys.maxsize)), default=1),
}
_FILTER_SIZES: dict[str, Callable[..., int]] = {
    "join": _join_size,
    "replace": lambda s, old, new, count=None: _replace_size(str(s), str(old), str(new), count),
    "indent": _indent_size,
    "center": lambda s, width=80: max(len(str(s)), width),
    "format": lambda s, *args, **kwargs: _format_size(str(s), [*args, *kwargs.values()]),
    "tojson": _json_size,
    "batch": lambda value, linecount, fill_with=None: 0 if fill_with is None else linecount,
    "slice": lambda value, slices, fill_with=None: slices,
    "sum": _sum_size,
}
