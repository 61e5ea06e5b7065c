"""The one exception type the CLI turns into a one-line message and exit code 2."""

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
