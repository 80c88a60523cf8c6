"""DosError and the one conversion from a dos_status to it."""

from __future__ import annotations

from dos._native import Status, lib

__all__ = ["DosError", "check", "call"]


class DosError(RuntimeError):
    """A failed DOS call: `code` is the dos_status (gRPC canonical code),
    `code_name` its name, `message` what was wrong and what to do."""

    def __init__(self, code: int, message: str):
        self.code = int(code)
        try:
            self.code_name = Status(self.code).name
        except ValueError:
            self.code_name = str(self.code)
        self.message = message
        super().__init__(f"{self.code_name}: {message}")


def check(status: int) -> None:
    """Raises DosError for a non-OK dos_status, with the calling thread's
    last error message from the library."""
    if status != Status.OK:
        raw = lib.dos_last_error()
        raise DosError(status, raw.decode("utf-8", "replace") if raw else "")


def call(name: str, *args) -> None:
    """Calls a dos_* function that returns dos_status and raises on error."""
    check(getattr(lib, name)(*args))
