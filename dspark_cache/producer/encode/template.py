"""The chat template argument, the identities the manifest records (template and tokenizer), and bounded renders."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from jinja2.sandbox import ImmutableSandboxedEnvironment

from dspark_cache.format.files import FileTooLargeError, NotARegularFileError, read_regular
from dspark_cache.producer.inputs.rows import InvalidRow

GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")
MAX_TEMPLATE_BYTES = 16 << 20  # the largest chat templates on the hub are tens of KiB


class ChatTemplateError(ValueError):
    """The chat template argument or the tokenizer's template is unusable."""


def resolve_chat_template(arg: str) -> str:
    """Inline Jinja is used as is; otherwise ``arg`` must be a file (raw Jinja or JSON)."""
    if "{%" in arg or "{{" in arg:
        return arg
    if not os.path.exists(arg):
        raise ChatTemplateError(
            f"--chat-template {arg!r} is neither an existing file nor an inline Jinja template "
            "(no '{%' or '{{' in it); fix the path or pass the template text"
        )
    try:  # a FIFO or device is refused, not opened; a huge file is refused, not read
        text = read_regular(arg, MAX_TEMPLATE_BYTES).decode("utf-8")
    except NotARegularFileError as exc:
        raise ChatTemplateError(
            f"--chat-template {arg} is {exc.reason}; pass a template file or the template text"
        ) from None
    except FileTooLargeError as exc:
        raise ChatTemplateError(
            f"--chat-template {arg} is {exc.size} bytes, more than a chat template can be "
            f"({MAX_TEMPLATE_BYTES >> 20} MiB); is it the right file?"
        ) from None
    except UnicodeDecodeError as exc:
        raise ChatTemplateError(
            f"--chat-template {arg} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
            "pass the template file"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return text
    if isinstance(data, dict) and isinstance(data.get("chat_template"), str):
        return data["chat_template"]
    return text


def sha256_text(text: str | None) -> str:
    return hashlib.sha256((text or "").encode()).hexdigest()


def tokenizer_sha256(tokenizer: Any) -> str:
    """Identity of the tokenizer's vocabulary, merges, normaliser and special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    specials = json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str)
    return hashlib.sha256((body + specials).encode()).hexdigest()


# --- bounded rendering ---------------------------------------------------------------------------
# A chat template is code from the model's repository. Jinja's sandbox stops it from escaping,
# not from looping (nested ``range``) or from rendering gigabytes, so every render of a row runs
# in an environment that checks a deadline and an output size as it goes; a row over either
# becomes an invalid row. Everything else is transformers' own environment (filters, globals,
# ``{% generation %}``), so a render within the bounds is the text ``apply_chat_template`` gives.

RENDER_SECONDS = 5.0  # per render of a row; a real template renders a row in well under a millisecond
RENDER_CHARS_PER_ROW_CHAR = 8  # a render may hold each character of the row this many times ...
RENDER_CHARS_FLOOR = 1 << 20  # ... plus this much (headers, a default system prompt, tool schemas)
# numbers a template computes stay far below this (big-int arithmetic cannot be interrupted)
_MAX_INT_BITS = 1 << 16
FORMATS = ("format", "format_map")  # the str methods that format their arguments into the string
_SPEC_DIGITS = re.compile(r"%[#0\- +]*(\d+)?(?:\.(\d+))?|\{[^{}]*?:[^{}]*?(\d+)(?:\.(\d+))?[^{}]*\}")


TOO_SLOW = "template too slow"  # the invalid-row reason of a render past its deadline


class TemplateLimitError(InvalidRow):
    """A render of this row ran over its time or size bound (raised from inside the template)."""


@dataclass
class RenderBudget:
    """The bounds of one render: a character count and a deadline (``time.monotonic``)."""

    chars: int
    seconds: float
    deadline: float = 0.0

    def too_slow(self) -> TemplateLimitError:
        return TemplateLimitError(TOO_SLOW, f"template rendering took over {self.seconds:g} s on this row "
                                  "(does the chat template loop?)")

    def too_large(self, what: str) -> TemplateLimitError:
        return TemplateLimitError(
            "template output too large",
            f"template rendering {what}, over the {self.chars} "
            f"characters allowed for this row ({RENDER_CHARS_PER_ROW_CHAR}x its text + "
            f"{RENDER_CHARS_FLOOR >> 20} MiB; does the chat template repeat itself?)",
        )

    def sized(self, value: Any) -> Any:
        if isinstance(value, (str, list, tuple, dict)) and len(value) > self.chars:
            raise self.too_large(f"made a {type(value).__name__} of {len(value)} items")
        if isinstance(value, int) and value.bit_length() > _MAX_INT_BITS:
            raise self.too_large(f"made a number of {value.bit_length()} bits")
        return value

    def check_args(self, args: tuple, kwargs: dict) -> None:
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > self.chars:
                raise self.too_large(f"was given a size argument of {value}")

    def check_spec(self, text: str) -> None:
        """A ``%``- or ``{}``-format string whose field widths alone exceed the bound."""
        if "%" in text or "{" in text:
            for match in _SPEC_DIGITS.finditer(text):
                if any(
                    group and len(group) > 7 or group and int(group) > self.chars for group in match.groups()
                ):
                    raise self.too_large(f"asked for a field width of {match.group()!r}")

    def check_replace(self, text: Any, old: Any, new: Any) -> None:
        if isinstance(text, str) and isinstance(old, str) and isinstance(new, str):
            if len(text) + text.count(old) * (len(new) - len(old)) > self.chars:
                raise self.too_large("would replace its way past the bound")

    def check_binop(self, op: str, left: Any, right: Any) -> None:
        seq = (str, list, tuple)
        if op == "*":
            if (
                isinstance(left, seq)
                and isinstance(right, int)
                or isinstance(right, seq)
                and isinstance(left, int)
            ):
                size, times = (len(left), right) if isinstance(left, seq) else (len(right), left)
                if size * times > self.chars:
                    raise self.too_large(f"repeated {size} items {times} times")
            elif isinstance(left, int) and isinstance(right, int) and \
                    left.bit_length() + right.bit_length() > _MAX_INT_BITS:
                raise self.too_large("multiplied numbers past the bound")
        elif op == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and \
                right * left.bit_length() > _MAX_INT_BITS:
            raise self.too_large(f"raised a number to the power {right}")
        elif (
            op == "+"
            and isinstance(left, seq)
            and isinstance(right, seq)
            and len(left) + len(right) > self.chars
        ):
            raise self.too_large(f"joined {len(left)} and {len(right)} items")
        elif op == "%" and isinstance(left, str):
            self.check_spec(left)
            self.check_args(right if isinstance(right, tuple) else (right,), {})


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' template environment with the checks above at every call, operator, attribute and filter."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    budget: RenderBudget | None = None  # set only while one of our renders runs

    def checked(self) -> RenderBudget | None:
        budget = self.budget
        if budget is not None and time.monotonic() > budget.deadline:
            raise budget.too_slow()
        return budget

    def getattr(self, obj: Any, attribute: str) -> Any:
        self.checked()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        self.checked()
        return super().getitem(obj, argument)

    def wrap_str_format(self, value: Any) -> Any:
        budget = self.checked()
        owner = getattr(value, "__self__", None)
        if budget is not None and isinstance(owner, str) and getattr(value, "__name__", "") in FORMATS:
            budget.check_spec(owner)
        return super().wrap_str_format(value)

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        budget = self.checked()
        if budget is None:
            return super().call(context, obj, *args, **kwargs)
        budget.check_args(args, kwargs)
        owner = getattr(obj, "__self__", None)
        if getattr(obj, "__name__", "") == "replace" and isinstance(owner, str) and len(args) >= 2:
            budget.check_replace(owner, args[0], args[1])
        return budget.sized(super().call(context, obj, *args, **kwargs))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = self.checked()
        if budget is not None:
            budget.check_binop(operator, left, right)
        result = super().call_binop(context, operator, left, right)
        return result if budget is None else budget.sized(result)

    def bounded_filter(self, name: str, func: Callable) -> Callable:
        """``func`` (a filter) with the checks; its ``pass_context``-style marker is kept (``wraps`` copies it)."""

        @functools.wraps(func)
        def bounded(*args: Any, **kwargs: Any) -> Any:
            budget = self.checked()
            if budget is None:
                return func(*args, **kwargs)
            budget.check_args(args, kwargs)
            values = [a for a in args if isinstance(a, str)]
            if name == "replace" and len(values) >= 3:
                budget.check_replace(*values[:3])
            if name == "format" and values:
                budget.check_spec(values[0])
            return budget.sized(func(*args, **kwargs))

        return bounded


def bounded_template(template: str) -> Any | None:
    """``template`` compiled in a :class:`BoundedEnvironment` copied from transformers' own, or None when this
    transformers has no compiled template to copy (its renders are then unbounded)."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # pragma: no cover - other transformers versions
        return None
    # The environment of an empty template: compiling ours there would fold its constant expressions unbounded.
    base = _compile_jinja_template("").environment
    env = base.overlay()  # the same options, extensions (``{% generation %}``), filters and globals
    env.__class__ = BoundedEnvironment  # operators are intercepted as the template is compiled, below
    env.filters = {name: env.bounded_filter(name, f) for name, f in base.filters.items()}
    env.globals = dict(base.globals)
    # Jinja folds constant expressions while compiling; a fold over the bounds is left to the render (and its row).
    env.budget = RenderBudget(RENDER_CHARS_FLOOR, RENDER_SECONDS, time.monotonic() + RENDER_SECONDS)
    try:
        return env.from_string(template)
    finally:
        env.budget = None


def _on_alarm(signum: int, frame: Any) -> None:
    if _ALARMED:  # else the render it was armed for has just finished
        raise _ALARMED[0].too_slow()


_ALARMED: list[RenderBudget] = []  # the budget of the render the alarm is armed for


def render_bounded(compiled: Any, budget: RenderBudget, spans: list | None, **context: Any) -> str:
    """The template's text for ``context``, within ``budget``; ``spans`` receives the ``{% generation %}`` spans.

    The checks run at every call, operator, attribute access and output piece. A loop that does none
    of these (an empty ``for`` over a long string) is stopped by SIGALRM where we can use it (the
    main thread: always in the encoding workers and the single-process producer).
    """
    env: BoundedEnvironment = compiled.environment
    pieces: list[str] = []
    budget.deadline = time.monotonic() + budget.seconds
    alarm = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGALRM, _on_alarm) if alarm else None
    env.budget = budget
    try:
        if alarm:
            _ALARMED.append(budget)
            signal.setitimer(signal.ITIMER_REAL, budget.seconds + 0.05)
        tracker = env.activate_tracker(pieces, spans) if spans is not None else contextlib.nullcontext()
        with tracker:
            total = 0
            for piece in compiled.generate(**context):
                total += len(piece)
                if total > budget.chars:
                    raise budget.too_large(f"passed {budget.chars} characters")
                pieces.append(piece)
                env.checked()
            return "".join(pieces)
    finally:
        env.budget = None
        if alarm:
            _ALARMED.clear()
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL if previous is None else previous)
