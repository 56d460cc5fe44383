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
