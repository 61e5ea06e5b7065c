"""Errors: ``GpuwiseError`` means "the user can fix this" (exit 2); the others are internal control flow.

The internal ones never reach the user as such: the code that raises them is always called by code
that catches them and decides (a remedy that does not apply is skipped, a damaged checkpoint is passed
over with a note). One that escapes is our bug (exit 3).
"""

from __future__ import annotations


class GpuwiseError(Exception):
    """A user-facing error: what is wrong, and what to do about it.

    >>> raise GpuwiseError("unknown GPU 'h1000'", hint="did you mean 'h100'? run 'gpuwise gpus'")
    """

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} (hint: {self.hint})" if self.hint else self.message


class NotApplicable(Exception):
    """A transformation that does not apply to this model or setup (LoRA without linear layers, ...)."""


class DamagedCheckpoint(Exception):
    """A checkpoint folder that cannot be read back: the message says what is wrong with it."""


def first_line(exc: BaseException, *, limit: int = 300) -> str:
    """``"TypeError: the first line of its message"``, at most ``limit`` characters of message.

    >>> first_line(ValueError("bad shape\\nlong details"))
    'ValueError: bad shape'
    """
    lines = [line.strip() for line in str(exc).strip().splitlines()]
    if len(lines) > 1 and lines[0].endswith(":"):  # "Validation error for field 'x':" says what only on the next
        lines[0] = f"{lines[0]} {lines[1]}"
    return f"{type(exc).__name__}: {lines[0][:limit]}" if lines else type(exc).__name__
