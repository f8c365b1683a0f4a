"""All exceptions of sequence_ai_ros, under one base class.

Errors are translated at the boundaries: the worker's servicer turns them into gRPC status codes and
in-stream ``Error`` messages (:mod:`sequence_ai_ros.protocol`), the client turns those back into these
classes, and the ROS node turns them into action results and service responses.
"""

from __future__ import annotations


class SequenceAIError(Exception):
    """Raised by sequence_ai_ros; the base of every error below."""


class ConfigError(SequenceAIError, ValueError):
    """Raised when a configuration value or parameter is invalid."""


class ContractViolation(SequenceAIError, ValueError):
    """Raised when data does not match the policy's contract (shape, dtype, camera, NaN, size)."""


class ActionSpaceMismatch(ContractViolation):
    """Raised when a chunk's action_space differs from the one the caller expects or commands."""


class ProtocolVersionError(SequenceAIError):
    """Raised when client and worker speak different protocol versions."""


class UnknownDeployment(SequenceAIError, LookupError):
    """Raised when the named deployment is not registered on the worker."""


class Unauthenticated(SequenceAIError):
    """Raised when a call lacks the worker's token, or carries a wrong one."""


class PolicyException(SequenceAIError):
    """Raised when the user's policy raised during load or inference; the message carries it."""


class Overloaded(SequenceAIError):
    """Raised when the worker refuses work because its queues are full; retry later.

    ``refusal``: why the worker refused a whole episode stream before it started (``max_streams``,
    ``per_client``, ``anonymous``, ``draining``), '' for a refused request.
    """

    def __init__(self, message: str = '', refusal: str = '') -> None:
        super().__init__(message)
        self.refusal = refusal


class Draining(Overloaded):
    """Raised when the replica refused a new episode because it is stopping; a new stream goes elsewhere.

    The client retries it itself (a balancer no longer sends that episode id to a draining replica); it
    reaches the caller only when every retry within the client's bound was refused.
    """


class NotReady(SequenceAIError):
    """Raised when the policy is still warming (or failed to load) and cannot serve yet.

    ``retry_after_s``: for a request the worker refused while the deployment loads (cold or warming), its
    estimate of the time left (s): the request may be sent again then (an episode does, before its first
    chunk); 0 when waiting will not help (the load failed, the worker stops, the episode was cut).
    """

    def __init__(self, message: str = '', retry_after_s: float = 0.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class PermissionDenied(SequenceAIError):
    """Raised when the worker refuses the caller what it asks.

    E.g. a label of an episode another client ran, or a label from a caller without the worker's token
    (``--anonymous-streams``).
    """


class EpisodeStateError(SequenceAIError):
    """Raised when an episode call comes in the wrong order (no start, a second start, ended)."""


class ConnectionLost(SequenceAIError, ConnectionError):
    """Raised when the worker cannot be reached, or the connection drops mid-run."""


class DeploymentError(SequenceAIError):
    """Raised when ``seq deploy`` rejects a policy (import, contract or dry-run failure)."""


class MissingDependency(SequenceAIError, ImportError):
    """Raised when an optional dependency is absent; the message says what to install."""


class CaptureError(SequenceAIError):
    """Raised when the capture store cannot write or read (quota, disk full, corruption)."""


class ExportError(SequenceAIError):
    """Raised when an export cannot be written (e.g. a non-empty --out without --force)."""
