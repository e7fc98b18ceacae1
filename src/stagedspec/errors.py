"""One exception type for every problem a user can cause.

The CLI turns a `StagedSpecError` into a one-line message and a non-zero exit
code; anything else is a bug and keeps its traceback.
"""


class StagedSpecError(Exception):
    """A problem with the user's input (path, file, parameter), stated in one line."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (or its type name): what a one-line error quotes."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
