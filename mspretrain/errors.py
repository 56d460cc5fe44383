"""User-facing errors.

A `UserError` is the only exception the CLI turns into a friendly message: one line naming the
cause, one line naming the fix, exit code 2. Anything else that escapes is a bug and keeps its
traceback so it can be reported.
"""
from __future__ import annotations


class UserError(Exception):
    """Bad input from a person: a missing file, a wrong value, a mismatched tokenizer."""

    def __init__(self, cause: str, fix: str = "") -> None:
        super().__init__(cause)
        self.cause = cause
        self.fix = fix

    def __str__(self) -> str:
        return f"{self.cause} — {self.fix}" if self.fix else self.cause


def env_number(name: str, default: float, *, kind: type = float, minimum: float = 0.0, value: str | None = None) -> float:
    """A number from the environment hook `name` (`default` when unset or empty), or a one-line
    UserError naming the variable: a value that is not a finite number of `kind` (int or float) at
    least `minimum` (a typo in an exported variable ended in a ValueError traceback, or for a
    silent hook in a NaN wait). `value`: the text already taken from the variable (e.g. a part of it)."""
    import math
    import os
    import re

    text = (os.environ.get(name, "") if value is None else value).strip()
    if not text:
        return default
    pattern = r"[0-9]{1,12}" if kind is int else r"([0-9]{1,12}(\.[0-9]{0,9})?|\.[0-9]{1,9})([eE][+-]?[0-9]{1,3})?"
    if not re.fullmatch(pattern, text) or not math.isfinite(float(text)) or float(text) < minimum:
        what = "a whole number" if kind is int else "a number"
        raise UserError(f"{name}={text[:40]!r} is not {what} of at least {minimum:g}",
                        f"unset {name} or set it to {what}, e.g. {name}={max(minimum, 1):g}")
    return int(text) if kind is int else float(text)
