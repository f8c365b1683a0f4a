"""Who a caller is, as far as the worker can tell: the identity that owns the episodes it runs.

An episode's owner is recorded in the capture store when it starts (``owners`` table of
:mod:`sequence_ai_ros.capture.index`); its labels, its outcome (the ``runs`` row its EpisodeEnd writes) and its
telemetry are then accepted only from that identity:

- with the worker's token (``seq serve --token-file``), a call carrying it is ``token:<16 hex>`` (the first
  16 hex digits of the token's SHA-256): every holder of the token is one identity, so token holders may label
  each other's episodes; robots that must not need workers with different tokens. A rotated token is a new
  identity: the episodes run under the old one are labelled with the old one.
- a call without the token (``--anonymous-streams``) is :data:`ANONYMOUS`: its episodes are served (and
  captured) but it may label none, and nobody else may either.
- without a token, the client's address (``addr:<host>``, from
  :func:`~sequence_ai_ros.worker.servicer.client_of`: the TCP peer, or through ``--proxy-socket`` the last
  ``x-forwarded-for`` entry the balancer wrote). That is all a tokenless worker knows: robots behind one NAT, one
  host or a balancer without ``--proxy-socket`` are one identity, and a robot whose address changed between its
  episode and its label is another one. The ``client_id`` of a Handshake or EpisodeStart is free text any
  caller may copy and is never part of an identity.
"""

from __future__ import annotations

import hashlib

#: The identity of a call without the token on a worker with one (``--anonymous-streams``).
ANONYMOUS = 'anonymous'
#: Why a Label was refused (``seq_labels_refused_total``'s ``reason``): a caller without the token, an episode
#: another identity ran, or past the bound of labels one identity may hold for episodes the worker never saw.
LABEL_REFUSALS = ('anonymous', 'not_owner', 'unseen_bound')


def identity(token: str | None, authenticated: bool, client: str) -> str:
    """Return the identity of a call.

    :param token: the worker's token, None without one.
    :param authenticated: the call carries ``authorization: Bearer <token>`` (checked by the caller).
    :param client: the client's address (:func:`~sequence_ai_ros.worker.servicer.client_of`).
    """
    if token is not None:
        if not authenticated:
            return ANONYMOUS
        return 'token:' + hashlib.sha256(token.encode('utf-8')).hexdigest()[:16]
    return f'addr:{client or "unknown"}'
