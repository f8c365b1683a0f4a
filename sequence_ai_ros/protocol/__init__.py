"""The wire protocol ``sequence_ai.v1`` between robots and policy workers.

- ``sequence_ai.proto``: the service and messages (stubs generated at build time by setup.py).
- :mod:`.spaces`: ActionSpace.  :mod:`.contract`: Contract, ObservationContract, CameraSpec.
- :mod:`.types`: Observation, Action.  :mod:`.codec`: numpy/image <-> Tensor/Image, no pickle.
- :mod:`.errors`: ErrorCode <-> exception <-> gRPC status.  :mod:`.messages`: Observation <-> request.

This package has no threads and no I/O; both the client and the worker import it.
"""

from sequence_ai_ros.protocol.contract import (
    PROTOCOL_VERSION,
    CameraSpec,
    Contract,
    ObservationContract,
)
from sequence_ai_ros.protocol.spaces import ActionSpace
from sequence_ai_ros.protocol.types import Action, Observation

#: Default worker port on 127.0.0.1 (``seq serve`` and ``connect()``); $SEQ_ENDPOINT overrides it.
DEFAULT_PORT = 50551
#: gRPC metadata keys.
EPISODE_ID_METADATA = 'x-episode-id'
DEPLOYMENT_METADATA = 'x-deployment'
AUTH_METADATA = 'authorization'
#: Trailing metadata of a call the worker refused (a draining replica's Handshake): ``Error.refusal``'s value.
REFUSAL_METADATA = 'x-refusal'
#: A stopping replica's refusal (``Error.refusal``, the Handshake's :data:`REFUSAL_METADATA`) and its
#: ``ReadyReply.state``.
DRAINING = 'draining'
#: Trailing metadata of a stored Label: :data:`LABEL_UNMATCHED` when the worker that stored it did not run the
#: episode (kept for the replica that did, merged by episode id at export; or a mistyped id).
LABEL_METADATA = 'x-label'
LABEL_UNMATCHED = 'unmatched'

__all__ = [
    'PROTOCOL_VERSION', 'DEFAULT_PORT', 'EPISODE_ID_METADATA', 'DEPLOYMENT_METADATA', 'AUTH_METADATA',
    'REFUSAL_METADATA', 'DRAINING', 'LABEL_METADATA', 'LABEL_UNMATCHED',
    'ActionSpace', 'Action', 'CameraSpec', 'Contract', 'Observation', 'ObservationContract',
]
