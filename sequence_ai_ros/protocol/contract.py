"""The policy's contract: what it needs as observation and what its action chunks mean.

Both sides use these dataclasses; :func:`Contract.to_proto`/:func:`Contract.from_proto` carry them in
the handshake. ``covers_seconds = chunk_length * dt``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence

from sequence_ai_ros.exceptions import ContractViolation
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol.limits import check_name
from sequence_ai_ros.protocol.spaces import ActionSpace

#: The wire protocol's version, checked exactly at the handshake. ``.2``: each telemetry frame carries its
#: control tick's grid index, chunk-step span and hold reason (one record per tick). ``.3``: the contract
#: declares the cameras the worker pads and how the robot aggregates overlapping chunks (a robot that
#: ignored the aggregate would play an ensembled checkpoint's chunks as plain chunks). ``Error.refusal``
#: (a refused Episode stream) is additive within ``.3``: a client without it reads the refusal as the
#: OVERLOADED error it always was.
PROTOCOL_VERSION = 'sequence_ai.v1.3'
#: How overlapping chunks are combined for one step (:attr:`Contract.aggregate`): ``latest_only`` (the
#: newest chunk replaces the others), ``weighted_average`` (ACT's temporal ensembling, Zhao et al. 2023,
#: Algorithm 2: weights ``exp(-temporal_ensemble_coeff * i)``, i = 0 the oldest prediction), ``average``
#: (equal weights, the same with a coefficient of 0).
AGGREGATES = ('latest_only', 'weighted_average', 'average')
#: ACT's published temporal-ensembling coefficient (LeRobot's ACTConfig and the paper's default).
ACT_TEMPORAL_ENSEMBLE_COEFF = 0.01
#: Largest chunk_length (actions per chunk) a contract may declare.
MAX_CHUNK_LENGTH = 10_000
#: Characters of client-supplied text echoed in an error message.
ECHO_LIMIT = 100
#: The least a worker accepts in one message of an Episode stream (bytes): a telemetry message carries camera
#: frames the contract may not declare (capture keeps every camera the robot has), one frame of two 1080p
#: JPEGs of noise is ~6 MB, so this floor leaves room for a frame of several large cameras.
MIN_RECEIVE_BYTES = 16 << 20


def clip(text: object, limit: int = ECHO_LIMIT) -> str:
    """Return ``str(text)`` cut to ``limit`` characters (with a marker), for echoing untrusted input in errors."""
    text = str(text)
    return text if len(text) <= limit else f'{text[:limit]}...(+{len(text) - limit} chars)'


def _clip_seq(names: Sequence[str], limit: int = 10) -> str:
    """Return a bounded repr of a list of client-supplied names (at most ``limit`` names, each clipped)."""
    shown = [clip(n, 40) for n in list(names)[:limit]]
    more = len(names) - limit
    return repr(shown) + (f' (+{more} more)' if more > 0 else '')


def _names(value: object, what: str) -> tuple[str, ...]:
    """Return ``value`` as a tuple of names; a plain string is refused (it would split into letters)."""
    if isinstance(value, (str, bytes)):
        raise ContractViolation(f'{what} must be a list of names, not the single string {clip(value, 40)!r}')
    try:
        return tuple(value)  # type: ignore[arg-type]  # any object: one that is not iterable raises TypeError
    except TypeError:
        raise ContractViolation(f'{what} must be a list of names, got {type(value).__name__}') from None


@dataclasses.dataclass(frozen=True)
class CameraSpec:
    """One camera the policy needs.

    :param key: observation key, e.g. ``'cam_high'``.
    :param width: expected width (px); 0 accepts any.
    :param height: expected height (px); 0 accepts any.
    :param encoding: wire encoding the robot should use: ``jpeg``, ``png`` or ``raw``.
    """

    key: str
    width: int = 0
    height: int = 0
    encoding: str = 'jpeg'

    def __post_init__(self) -> None:
        if not self.key:
            raise ContractViolation('camera key must not be empty')
        # the rule every request's image keys are held to (protocol/limits.py): a contract whose camera no
        # request could carry is refused when it is declared (at seq deploy), not at every request
        check_name(self.key, 'camera key')
        if self.encoding not in ('jpeg', 'png', 'raw'):
            raise ContractViolation(f'camera {self.key!r}: encoding {self.encoding!r} not jpeg|png|raw')
        if self.width < 0 or self.height < 0:
            raise ContractViolation(f'camera {self.key!r}: negative size')


@dataclasses.dataclass(frozen=True)
class ObservationContract:
    """What an observation must hold.

    :param cameras: the cameras, by key.
    :param state_names: names of the (D,) float32 state vector, in order; their count is state_dim.
    :param history: the robot sends the last N frames (N >= 1; 1 = only the current one),
        sampled at the policy's dt.
    :param padded_cameras: the policy's own cameras the worker pads (as LeRobot pads a camera the robot
        lacks, e.g. SmolVLA's ``empty_cameras``): declared, never demanded from the robot.
    :raises ContractViolation: for history < 1, duplicate camera keys or duplicate/empty state names, or a
        padded camera that is empty, repeated or also demanded.
    """

    # sequences as given (a list, a tuple...); __post_init__ keeps them as tuples
    cameras: Sequence[CameraSpec] = ()
    state_names: Sequence[str] = ()
    history: int = 1
    padded_cameras: Sequence[str] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, 'cameras', tuple(self.cameras))
        object.__setattr__(self, 'state_names', _names(self.state_names, 'state_names'))
        padded = _names(self.padded_cameras, 'padded_cameras')
        object.__setattr__(self, 'padded_cameras', padded)
        if any(not n for n in padded) or len(set(padded)) != len(padded):
            raise ContractViolation(f'padded_cameras must be unique and non-empty, got {_clip_seq(padded)}')
        both = sorted(set(padded) & {c.key for c in self.cameras})
        if both:
            raise ContractViolation(f'cameras {_clip_seq(both)} are both demanded and padded')
        if not isinstance(self.history, numbers.Integral) or isinstance(self.history, bool):
            raise ContractViolation(f'history must be an integer number of frames, got {self.history!r}')
        if self.history < 1:
            raise ContractViolation(f'history must be >= 1, got {self.history}')
        keys = [c.key for c in self.cameras]
        if len(set(keys)) != len(keys):
            raise ContractViolation(f'duplicate camera keys {keys}')
        if any(not n for n in self.state_names) or len(set(self.state_names)) != len(self.state_names):
            raise ContractViolation('state_names must be unique and non-empty')

    @property
    def state_dim(self) -> int:
        """Length D of the state vector."""
        return len(self.state_names)

    def camera(self, key: str) -> CameraSpec | None:
        """Return the spec for ``key``, or None."""
        return next((c for c in self.cameras if c.key == key), None)


@dataclasses.dataclass(frozen=True)
class Contract:
    """A policy's contract.

    :param action_space: the meaning of each action vector.
    :param action_names: names of the D action dimensions, in order.
    :param dt: action period (s); 1/dt is the policy's control rate (Hz).
    :param chunk_length: actions per chunk T (the action horizon): an integer in 1..MAX_CHUNK_LENGTH; a
        chunk may be shorter, never longer.
    :param observation: the observation contract.
    :param streaming: stateful per episode (True) or stateless.
    :param gripper: how the gripper channel is handled, in words.
    :param aggregate: how the robot combines overlapping chunks for one step, one of :data:`AGGREGATES`
        (what the policy was run with, e.g. ``weighted_average`` for an ACT checkpoint trained with temporal
        ensembling); anything but ``latest_only`` needs an absolute action space.
    :param temporal_ensemble_coeff: ``weighted_average``'s coefficient m (weights ``exp(-m * i)``); 0 for
        the other aggregates.
    :raises ContractViolation: for dt <= 0, a chunk_length that is not an integer in 1..10000, action names
        given as one string, no action names, or duplicates; an unknown aggregate, a non-finite
        coefficient, a coefficient without weighted_average, or an aggregate on a delta or velocity space.
    """

    action_space: ActionSpace
    action_names: Sequence[str]          # as given; __post_init__ keeps a tuple
    dt: float
    chunk_length: int
    observation: ObservationContract = dataclasses.field(default_factory=ObservationContract)
    streaming: bool = False
    gripper: str = ''
    deployment: str = ''
    version: int = 0
    aggregate: str = 'latest_only'
    temporal_ensemble_coeff: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, 'action_space', ActionSpace.parse(self.action_space))
        object.__setattr__(self, 'aggregate', self.aggregate or 'latest_only')
        check_aggregate(self.aggregate, self.temporal_ensemble_coeff, self.action_space)
        object.__setattr__(self, 'temporal_ensemble_coeff', float(self.temporal_ensemble_coeff))
        object.__setattr__(self, 'action_names', _names(self.action_names, 'action_names'))
        if not (isinstance(self.dt, (int, float)) and math.isfinite(self.dt) and self.dt > 0):
            raise ContractViolation(f'dt must be a positive number of seconds, got {self.dt!r}')
        if not isinstance(self.chunk_length, numbers.Integral) or isinstance(self.chunk_length, bool):
            raise ContractViolation(f'chunk_length must be an integer number of actions, got {self.chunk_length!r}')
        if not 1 <= self.chunk_length <= MAX_CHUNK_LENGTH:
            raise ContractViolation(f'chunk_length must be in 1..{MAX_CHUNK_LENGTH}, got {self.chunk_length}')
        object.__setattr__(self, 'chunk_length', int(self.chunk_length))
        if not self.action_names:
            raise ContractViolation('action_names must name every action dimension')
        if any(not n for n in self.action_names) or len(set(self.action_names)) != len(self.action_names):
            raise ContractViolation('action_names must be unique and non-empty')

    @property
    def action_dim(self) -> int:
        """Length D of each action."""
        return len(self.action_names)

    @property
    def covers_seconds(self) -> float:
        """Seconds one chunk covers: chunk_length * dt (s)."""
        return self.chunk_length * self.dt

    def max_message_bytes(self) -> int:
        """The largest request the worker should accept, from the declared images.

        Raw frames are the worst case: width * height * 3 per camera per history frame, plus 1 MiB
        for state, chunk tail and framing. Cameras with size 0 count as 1920x1080.
        """
        per_frame = sum((c.width or 1920) * (c.height or 1080) * 3 for c in self.observation.cameras)
        return per_frame * max(1, self.observation.history) + (1 << 20)

    def receive_bytes(self) -> int:
        """The largest message a worker serving this contract accepts on an Episode stream (bytes).

        :func:`receive_limit` of :meth:`max_message_bytes`: the robot packs telemetry into messages no larger.
        """
        return receive_limit(self.max_message_bytes())

    def to_proto(self, *, ready: bool = False, eta_seconds: float = 0.0) -> pb.Contract:
        """Return the handshake's ``Contract`` message."""
        obs = self.observation
        return pb.Contract(
            deployment=self.deployment, version=self.version,
            action_space=self.action_space.to_proto(), gripper=self.gripper,
            action_dim=self.action_dim, action_names=list(self.action_names), dt=self.dt,
            chunk_length=self.chunk_length, covers_seconds=self.covers_seconds,
            observation=pb.ObservationContract(
                cameras=[pb.CameraSpec(key=c.key, width=c.width, height=c.height, encoding=c.encoding)
                         for c in obs.cameras],
                state_dim=obs.state_dim, state_names=list(obs.state_names), history=obs.history,
                padded_cameras=list(obs.padded_cameras)),
            streaming=self.streaming, ready=ready, eta_seconds=eta_seconds,
            max_message_bytes=self.max_message_bytes(), protocol_version=PROTOCOL_VERSION,
            aggregate=self.aggregate, temporal_ensemble_coeff=self.temporal_ensemble_coeff)

    @classmethod
    def from_proto(cls, msg: pb.Contract) -> Contract:
        """Build a contract from the handshake's message.

        :raises ContractViolation: when the message is inconsistent (e.g. action_dim vs names).
        """
        if msg.action_dim != len(msg.action_names):
            raise ContractViolation(f'contract: action_dim {msg.action_dim} but '
                                    f'{len(msg.action_names)} action names')
        try:
            space = ActionSpace.from_proto(msg.action_space)
        except ValueError as exc:
            raise ContractViolation(f'contract: {exc}') from None
        o = msg.observation
        return cls(
            action_space=space, action_names=tuple(msg.action_names), dt=msg.dt,
            chunk_length=msg.chunk_length,
            observation=ObservationContract(
                cameras=tuple(CameraSpec(c.key, c.width, c.height, c.encoding or 'jpeg') for c in o.cameras),
                state_names=tuple(o.state_names), history=max(1, o.history),
                padded_cameras=tuple(o.padded_cameras)),
            streaming=msg.streaming, gripper=msg.gripper, deployment=msg.deployment, version=msg.version,
            aggregate=msg.aggregate or 'latest_only', temporal_ensemble_coeff=msg.temporal_ensemble_coeff)

    def with_names(self, deployment: str, version: int) -> Contract:
        """Return a copy stamped with the deployment's name and version."""
        return dataclasses.replace(self, deployment=deployment, version=version)


def check_aggregate(aggregate: object, coeff: object, space: ActionSpace | None = None) -> None:
    """Check an aggregate and its coefficient (the contract's, or a robot's own choice).

    :param aggregate: one of :data:`AGGREGATES`.
    :param coeff: weighted_average's coefficient (finite; any sign, as ACT's); 0 for the other aggregates.
    :param space: the action space it applies to; None skips that check.
    :raises ContractViolation: naming what is wrong.
    """
    if aggregate not in AGGREGATES:
        raise ContractViolation(f'aggregate {clip(aggregate, 40)!r}: one of {", ".join(AGGREGATES)}')
    if isinstance(coeff, bool) or not isinstance(coeff, numbers.Real) or not math.isfinite(coeff):
        raise ContractViolation(f'temporal_ensemble_coeff must be a finite number, got {clip(coeff, 40)!r}')
    if coeff != 0 and aggregate != 'weighted_average':
        raise ContractViolation(f'temporal_ensemble_coeff={coeff} is weighted_average\'s; aggregate is {aggregate}')
    if space is not None and aggregate != 'latest_only' and not space.is_absolute:
        raise ContractViolation(f'aggregate {aggregate} averages absolute targets; {space.value} chunks carry '
                                'increments or rates (use latest_only)')


def check_names(given: Sequence[str], expected: Sequence[str], what: str) -> None:
    """Check that ``given`` names equal ``expected``, in order.

    :raises ContractViolation: naming the missing, extra or reordered entries.
    """
    if list(given) == list(expected):
        return
    missing = [n for n in expected if n not in given]
    extra = [n for n in given if n not in expected]
    detail = f'missing {_clip_seq(missing)}' if missing else ''
    detail += (', ' if detail and extra else '') + (f'unexpected {_clip_seq(extra)}' if extra else '')
    raise ContractViolation(f'{what} names differ from the contract: {detail or "order differs"}')


def receive_limit(max_message_bytes: int) -> int:
    """The largest message (bytes) a worker accepts on an Episode stream, given its largest contract's request.

    Four times the largest request (so an oversized observation reaches the worker and gets a typed
    CONTRACT_VIOLATION, not a transport error that kills the stream), and at least :data:`MIN_RECEIVE_BYTES`
    (a telemetry message with the robot's own cameras). The worker sets its transport limit to this over its
    contracts; a robot packs each telemetry message within it for its contract (:meth:`Contract.receive_bytes`),
    which is never more than the worker's.
    """
    return max(MIN_RECEIVE_BYTES, 4 * int(max_message_bytes))
