"""The error a request can never be served with, shared by every front door (HTTP, gRPC, offline).

Its own module so that `sampling_params` and `grammar`, which both raise it, need not import each
other for it.
"""

from __future__ import annotations


def quoted(value: object, limit: int = 64) -> str:
    """`repr(value)`, cut to `limit` characters with the full length said: an error message quotes at
    most this much of what a client sent (a 1 MB model name is not echoed back)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


class InvalidRequestError(ValueError):
    """A request that can never be served as asked; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
