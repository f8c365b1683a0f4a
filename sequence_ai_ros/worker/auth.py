"""The worker's token check, one rule for every port: ``Authorization: Bearer <token>``.

The gRPC calls carry it as ``authorization`` metadata, a ``--metrics-port`` scrape as an HTTP header. The
scheme is matched in any case (HTTP authentication schemes are case-insensitive, RFC 9110 section 11.1), the
token exactly, in constant time (:func:`hmac.compare_digest`).
"""

from __future__ import annotations

import hmac

#: The authentication scheme, lower case.
SCHEME = b'bearer'


def bearer_token(value: str | bytes) -> bytes | None:
    """Return the credentials of an ``Authorization`` value whose scheme is Bearer (any case), else None."""
    raw = value.encode('utf-8', 'replace') if isinstance(value, str) else bytes(value)
    scheme, space, credentials = raw.strip().partition(b' ')
    return credentials.strip() if space and scheme.lower() == SCHEME else None


def authorized(value: str | bytes, token: str) -> bool:
    """True when ``value`` is ``Bearer <token>`` (the scheme in any case, the token exactly)."""
    got = bearer_token(value)
    return hmac.compare_digest(got if got is not None else b'', token.encode()) and got is not None
