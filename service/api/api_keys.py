"""The API-key check both transports share: HTTP's `APIKeyGuard` and gRPC's `APIKeyInterceptor` hand it
the value of their `authorization` header or metadata. No framework here, so it is tested on its own."""

from __future__ import annotations

import hmac
from collections.abc import Iterable


class APIKeys:
    """Accepts exactly `Bearer <one of the keys>` (the scheme in any case): not a prefix of a key, not
    an empty token, not another scheme."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = [k.encode() for k in keys]

    def accept(self, authorization: str | bytes) -> bool:
        raw = authorization if isinstance(authorization, bytes) else authorization.encode()
        scheme, _, token = raw.partition(b" ")
        return self.accept_key(token.strip()) and scheme.lower() == b"bearer"

    def accept_key(self, token: bytes) -> bool:
        """Whether `token` is one of the keys, whole (Anthropic's `x-api-key` header carries it bare)."""
        # Compare with every key in constant time, with no early exit: the time taken says nothing
        # about which key matched or how much of one.
        matches = [hmac.compare_digest(token, key) for key in self._keys]
        return any(matches)
