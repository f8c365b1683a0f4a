"""The gRPC side of the client: one channel per connect(), one Episode bidi stream per episode.

Threads, per episode (owned by :class:`EpisodeCall`, stopped by :meth:`EpisodeCall.close` with timed joins):

- gRPC's own request-consumer thread pulls what the engine enqueued (observation requests, telemetry
  batches, EpisodeEnd) and packs each there, then hands it to gRPC: nothing is encoded on the control
  thread, and there is no extra packing thread to hand each request through. An observation request is
  packed straight into its wire bytes (:func:`~sequence_ai_ros.protocol.messages.observation_request_bytes`:
  one copy of the pixels, not three); the call's serializer passes those bytes through.
- ``seq-recv-<episode>`` opens the call, reads replies (EpisodeStarted, ActionChunk, Error,
  EpisodeEnded) and hands them to callbacks; a broken stream becomes a typed error there. When a draining
  replica refuses the episode before it starts, the same thread opens the call again (same id) after a pause.

Every unary call
(Handshake, Ready, Label) carries a deadline; nothing waits forever. Ready and Label carry the episode's
``x-episode-id``, as its stream does, so a consistent-hash balancer sends them to the episode's replica.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import itertools
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TypeVar

import grpc

from sequence_ai_ros.client.engine import OutRequest
from sequence_ai_ros.client.sampling import TelemetrySample
from sequence_ai_ros.exceptions import CaptureError, ConnectionLost, Draining, NotReady, SequenceAIError
from sequence_ai_ros.malloc_tuning import tune_malloc
from sequence_ai_ros.protocol import (
    AUTH_METADATA,
    DEFAULT_PORT,
    DEPLOYMENT_METADATA,
    EPISODE_ID_METADATA,
    LABEL_METADATA,
    LABEL_UNMATCHED,
    codec,
    errors,
    tracing,
)
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.protocol.contract import Contract
from sequence_ai_ros.protocol.messages import observation_request_bytes
from sequence_ai_ros.protocol.types import ImageLike, Observation

LOG = logging.getLogger(__name__)


class _Signal(enum.Enum):
    """Outbox items that are not messages.

    CLOSE ends a call's request iterator; WAKE wakes it (its call was refused: it ends).
    """

    CLOSE = 'close'
    WAKE = 'wake'


_Request = TypeVar('_Request')
_Reply = TypeVar('_Reply')
#: What an episode's outbox carries besides a :class:`_Signal`: requests, telemetry batches, EpisodeEnd.
_Outgoing = OutRequest | list[TelemetrySample] | pb.EpisodeEnd
#: Fits a record's camera frames to the contract (:meth:`.ObservationAdapter.fit_frames`).
_FitFrames = Callable[[Mapping[str, ImageLike]], Mapping[str, ImageLike]]


#: How long (s) an episode a draining replica refused is opened again before Draining reaches the caller.
DRAIN_RETRY_S = 5.0
#: Pause before it is opened again (s), times the attempt number (at most 1 s).
DRAIN_RETRY_PAUSE_S = 0.1
#: Largest message either way (bytes); the worker enforces the contract's own limit on requests.
MAX_MESSAGE_BYTES = 64 << 20
#: Label calls at most per label (the first and its retries on UNAVAILABLE, all with the episode's id).
LABEL_ATTEMPTS = 3
#: Pause before a retry (s), times the attempt number.
RETRY_PAUSE_S = 0.1
TlsLike = bool | str | Path | grpc.ChannelCredentials | None


#: How a Python API user points the client elsewhere (the policy node says its own way: a parameter).
ENDPOINT_HINT = 'set the endpoint with connect(endpoint=...) or $SEQ_ENDPOINT'


def resolve_endpoint(endpoint: str | None) -> str:
    """Return ``endpoint``, else $SEQ_ENDPOINT, else ``127.0.0.1:DEFAULT_PORT``."""
    return endpoint or os.environ.get('SEQ_ENDPOINT') or f'127.0.0.1:{DEFAULT_PORT}'


def _credentials(tls: TlsLike) -> grpc.ChannelCredentials | None:
    if tls is None or tls is False:
        return None
    if tls is True:
        return grpc.ssl_channel_credentials()
    if isinstance(tls, (str, Path)):
        return grpc.ssl_channel_credentials(root_certificates=Path(tls).read_bytes())
    return tls


def check_certificate(endpoint: str, roots: bytes | None, where: str, timeout: float = 2.0) -> str | None:
    """Return why the certificate of the TLS worker at ``endpoint`` is refused, or None (trusted, or unknown).

    One TCP connection and TLS handshake, bounded by ``timeout`` (s), verified as the channel verifies it:
    against ``roots`` (PEM bytes; None: the system roots) and for the endpoint's host name or address.

    :param where: how the roots were given, for the message (``tls='ca.pem'``, ``the system roots``).
    """
    import ssl

    host, sep, port = endpoint.rpartition(':')
    if not sep or not port.isdigit() or '/' in host:
        return None
    host = host.strip('[]') or '127.0.0.1'
    try:
        ctx = ssl.create_default_context(cadata=roots.decode('ascii', 'replace') if roots is not None else None)
        ctx.set_alpn_protocols(['h2'])
        with socket.create_connection((host, int(port)), timeout=timeout) as sock, \
                ctx.wrap_socket(sock, server_hostname=host):
            return None
    except ssl.SSLCertVerificationError as exc:
        why = str(getattr(exc, 'verify_message', '') or exc)
        if 'hostname' in why.lower() or 'ip address mismatch' in why.lower():
            if not _has_subject_alt_name(host, int(port), timeout):
                return None   # a certificate naming its host in the subject CN alone: gRPC decides
            return (f'the certificate of the worker at {endpoint} is not valid for {host!r} ({why}): connect '
                    'with a host name or address its certificate names (its subjectAltName)')
        return (f'the certificate of the worker at {endpoint} is not trusted by {where} ({why}): pass the CA that '
                "signed the worker's --tls-cert as tls='ca.pem' (for a self-signed certificate, that certificate)")
    except (OSError, ValueError, ssl.SSLError):
        return None   # unreachable, or not a TLS problem of the certificate: the handshake call decides


#: DER of the subjectAltName extension's OID, 2.5.29.17
_SAN_OID = bytes.fromhex('0603551d11')


def _has_subject_alt_name(host: str, port: int, timeout: float) -> bool:
    """True when the worker's certificate has a subjectAltName extension (True when it cannot be read)."""
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE   # only to read the certificate; nothing is sent
    ctx.set_alpn_protocols(['h2'])
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock, ctx.wrap_socket(sock) as tls:
            der = tls.getpeercert(binary_form=True) or b''
    except (OSError, ssl.SSLError):
        return True
    return _SAN_OID in der


def _client_hello() -> bytes:
    """A TLS ClientHello (ALPN h2), as the first bytes a TLS client sends; nothing is verified with it."""
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE     # only to see which transport answers; the channel verifies
    ctx.set_alpn_protocols(['h2'])
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def probe_transport(endpoint: str, timeout: float = 1.0) -> str | None:
    """Return 'plaintext' or 'tls' as the worker at ``endpoint`` speaks it, or None when unknown (unreachable...).

    One TCP connection, bounded by ``timeout`` (s): it sends a TLS ClientHello and reads the first bytes back.
    A TLS worker answers with its ServerHello (a handshake record) or an alert; a plaintext gRPC worker sends
    its HTTP/2 SETTINGS frame first, whatever it reads. A plaintext HTTP/2 preface would make a TLS worker's
    gRPC core log a non-JSON ``Handshake failed ... WRONG_VERSION_NUMBER`` line on every connect; a
    ClientHello it reads as the start of a handshake, which the probe leaves (gRPC logs nothing). A connection
    closed or reset without a byte is unknown (a plaintext gateway closes on a ClientHello).
    """
    host, sep, port = endpoint.rpartition(':')
    if not sep or not port.isdigit() or '/' in host:
        return None
    host = host.strip('[]') or '127.0.0.1'
    try:
        hello = _client_hello()
        with socket.create_connection((host, int(port)), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(hello)
            data = sock.recv(9)
    except OSError:             # unreachable, reset, or nothing came within the timeout (ssl.SSLError is one too)
        return None
    # A connection closed without a byte says nothing: a plaintext HTTP/2 gateway (HAProxy) closes on a
    # ClientHello as a TLS one might; only a TLS record (an alert or a handshake) says TLS.
    if data and data[0] in (0x15, 0x16):
        return 'tls'
    if len(data) >= 4 and data[3] == 0x04:   # an HTTP/2 frame header of type SETTINGS (length < 2**16)
        return 'plaintext'
    return None


class Connection:
    """One channel to a worker, with the token as call metadata.

    :param endpoint: ``host:port``.
    :param token: sent as ``authorization: Bearer <token>`` on every call, or None.
    :param tls: None/False for plaintext, True for system roots, a PEM path, or ChannelCredentials.
    """

    def __init__(self, endpoint: str, token: str | None = None, tls: TlsLike = None) -> None:
        tune_malloc()   # per-request image buffers: no mmap/munmap per call (SEQ_MALLOC_TUNING=0: off)
        self.endpoint = endpoint
        self.token = token
        options = [('grpc.max_send_message_length', MAX_MESSAGE_BYTES),
                   ('grpc.max_receive_message_length', MAX_MESSAGE_BYTES)]
        creds = _credentials(tls)
        self.tls = creds is not None
        #: the roots the channel verifies with, to name a certificate problem at once: (PEM or None for the
        #: system roots, how they were given); None when unknown (credentials built by the caller)
        self._roots: tuple[bytes | None, str] | None = None
        if tls is True:
            self._roots = (None, 'the system roots (tls=True)')
        elif isinstance(tls, (str, Path)):
            self._roots = (Path(tls).read_bytes(), f"the CA in tls='{tls}'")
        self.channel = (grpc.secure_channel(endpoint, creds, options=options) if creds is not None
                        else grpc.insecure_channel(endpoint, options=options))
        self.stub = pb_grpc.PolicyServiceStub(self.channel)
        #: the Episode stream, whose requests may be wire bytes built beforehand (see :class:`EpisodeCall`)
        self.episode_stream = self.channel.stream_stream(EPISODE_METHOD, request_serializer=_serialize_request,
                                                  response_deserializer=pb.EpisodeReply.FromString)
        self.metadata: tuple[tuple[str, str], ...] = ((AUTH_METADATA, f'Bearer {token}'),) if token else ()

    def _unary(self, method: grpc.UnaryUnaryMultiCallable[_Request, _Reply], request: _Request, timeout: float,
               wait_for_ready: bool = False, episode_id: str = '', attempts: int = 1,
               trailers: dict[str, str] | None = None) -> _Reply:
        """Call ``method`` within ``timeout`` s in all; retry UNAVAILABLE up to ``attempts`` calls in all.

        With ``episode_id``, every attempt carries it as ``x-episode-id``, so a consistent-hash balancer sends
        the call, and its retries, to that episode's replica. ``trailers``, when given, receives the answered
        call's trailing metadata (text values).
        """
        metadata = (*self.metadata, (EPISODE_ID_METADATA, episode_id)) if episode_id else self.metadata
        deadline = time.monotonic() + timeout
        for attempt in range(1, attempts + 1):
            try:
                left = max(0.001, deadline - time.monotonic())
                if trailers is None:
                    return method(request, timeout=left, metadata=metadata, wait_for_ready=wait_for_ready)
                reply, call = method.with_call(request, timeout=left, metadata=metadata, wait_for_ready=wait_for_ready)
                trailers.update((str(k), v) for k, v in (call.trailing_metadata() or ()) if isinstance(v, str))
                return reply
            except grpc.RpcError as exc:
                left = deadline - time.monotonic()
                if exc.code() == grpc.StatusCode.UNAVAILABLE and attempt < attempts and left > RETRY_PAUSE_S:
                    LOG.debug('%s: %s; retrying (%d of %d)', method, exc.code().name, attempt + 1, attempts)
                    time.sleep(RETRY_PAUSE_S * attempt)
                    continue
                error = errors.from_rpc_error(exc)
                if wait_for_ready and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    # the call waited for a worker that may still be starting: none answered in time
                    error = ConnectionLost(f'no worker answered within {timeout:.3g} s (the connect timeout: a worker '
                                           f'still starting is waited for that long)')
                if isinstance(error, ConnectionLost):   # say where we looked, and how to look elsewhere
                    error = ConnectionLost(f'{error} (endpoint {self.endpoint}; is `seq serve` running there? '
                                           f'{ENDPOINT_HINT})')
                raise error from None
        raise AssertionError('unreachable')   # the last attempt returns or raises

    def handshake(self, deployment: str, client_id: str, timeout: float) -> pb.Contract:
        """Send the handshake (which starts a cold worker warming) and return its contract message.

        A draining replica refuses it (:class:`~sequence_ai_ros.exceptions.Draining`): it is sent again after
        a pause, as a refused episode is, so a balancer sends it to another replica, for up to
        :data:`DRAIN_RETRY_S` within ``timeout``.

        :raises ConnectionLost: when the worker is unreachable within ``timeout`` (s).
        :raises Draining: when every try within that bound was refused by a draining replica.
        :raises UnknownDeployment, ProtocolVersionError, Unauthenticated: as the worker answers.
        """
        from sequence_ai_ros.protocol.contract import PROTOCOL_VERSION

        self.check_transport()
        req = pb.HandshakeRequest(deployment=deployment, protocol_version=PROTOCOL_VERSION,
                                  token=self.token or '', client_id=client_id)
        start = time.monotonic()
        deadline = start + timeout
        for attempt in itertools.count(1):
            try:
                return self._unary(self.stub.Handshake, req, max(0.001, deadline - time.monotonic()),
                                   wait_for_ready=True).contract
            except Draining as refusal:
                pause = min(DRAIN_RETRY_PAUSE_S * attempt, 1.0)
                if time.monotonic() + pause > min(deadline, start + DRAIN_RETRY_S):
                    raise
                LOG.info('handshake %s: %s; sending it again (attempt %d)', deployment, refusal, attempt + 1)
                time.sleep(pause)
        raise AssertionError('unreachable')   # the last attempt returns or raises

    def check_transport(self) -> None:
        """Fail fast, naming the TLS problem: a transport mismatch, or a certificate that is refused.

        A mismatch: the worker speaks TLS and this client plaintext, or the reverse. A refused certificate:
        not signed by the given CA (or the system roots), or not for the endpoint's host name.

        Without it gRPC retries the mismatched handshake until the deadline and reports only "unavailable".

        :raises ConnectionLost: on a mismatch (an unreachable or unknown endpoint passes: the handshake decides).
        """
        spoken = probe_transport(self.endpoint)
        if spoken == 'tls' and not self.tls:
            raise ConnectionLost(f'the worker at {self.endpoint} speaks TLS but this client connects in plaintext: '
                                 "pass connect(tls=True) or tls='ca.pem' (the worker's --tls-cert)")
        if spoken == 'plaintext' and self.tls:
            raise ConnectionLost(f'this client connects with TLS but the worker at {self.endpoint} speaks plaintext '
                                 '(no TLS): drop tls=, or start seq serve with --tls-cert and --tls-key')
        if spoken == 'tls' and self._roots is not None:
            why = check_certificate(self.endpoint, *self._roots)
            if why:   # gRPC would retry the refused handshake until the deadline, then say only "unavailable"
                raise ConnectionLost(why)

    def ready(self, deployment: str, timeout: float, episode_id: str = '') -> pb.ReadyReply:
        """Return the worker's ReadyReply (ready, eta_seconds, state, message); never blocks past ``timeout``.

        :param episode_id: sent as ``x-episode-id``, so a balancer asks the replica that episode runs (or
            will run) on; '' lets it pick any.
        """
        return self._unary(self.stub.Ready, pb.ReadyRequest(deployment=deployment), timeout, episode_id=episode_id)

    def label(self, deployment: str, episode_id: str, success: bool, notes: str, timeout: float) -> pb.LabelReply:
        """Label an episode; return the worker's reply (see :meth:`label_call`)."""
        return self.label_call(deployment, episode_id, success, notes, timeout)[0]

    def label_call(self, deployment: str, episode_id: str, success: bool, notes: str,
                   timeout: float) -> tuple[pb.LabelReply, bool]:
        """Label an episode; return (the worker's reply, whether the worker that answered ran the episode).

        The call carries ``x-episode-id`` (so a consistent-hash balancer sends it to the episode's replica,
        whose store holds it) and is retried with the same id, within ``timeout`` s in all, when the worker
        is unavailable (:data:`LABEL_ATTEMPTS` calls at most; storing a label twice stores it once). The
        worker says it did not run the episode in the trailing metadata ``x-label: unmatched``.
        """
        req = pb.LabelRequest(deployment=deployment, episode_id=episode_id, success=success, notes=notes)
        trailers: dict[str, str] = {}
        reply = self._unary(self.stub.Label, req, timeout, episode_id=episode_id, attempts=LABEL_ATTEMPTS,
                            trailers=trailers)
        return reply, trailers.get(LABEL_METADATA) != LABEL_UNMATCHED

    def close(self) -> None:
        """Close the channel (idempotent)."""
        self.channel.close()


#: The Episode method's path (``/sequence_ai.v1.PolicyService/Episode``), from the proto.
EPISODE_METHOD = f"/{pb.DESCRIPTOR.services_by_name['PolicyService'].full_name}/Episode"


def _serialize_request(item: bytes | pb.EpisodeRequest) -> bytes:
    """The Episode call's request serializer: wire bytes already built pass through; a message serializes."""
    return item if isinstance(item, bytes) else item.SerializeToString()


#: Bytes a telemetry message may hold besides its frames: the EpisodeRequest and Telemetry tags and lengths.
_MESSAGE_OVERHEAD = 16
#: Bytes an image adds to its frame besides its data, key and encoding: tags, lengths, width, height, channels.
_IMAGE_OVERHEAD = 48


@dataclasses.dataclass
class TelemetryPacking:
    """A telemetry batch packed into messages that each fit the worker's limit.

    :param messages: the Telemetry messages, in order; each at most ``limit`` bytes as an EpisodeRequest.
    :param problems: why each camera frame that could not be fitted or encoded was left out (the frame goes).
    :param over_limit: '' when every record was packed; else why capture stops: the first record that is
        larger than the limit alone (its size and the limit), which and every record after it are left out.
    """

    messages: list[pb.Telemetry]
    problems: list[str]
    over_limit: str = ''


def _pack_frame(f: TelemetrySample, order: list[str], fit: _FitFrames | None,
                problems: list[str]) -> tuple[pb.TelemetryFrame, int]:
    """One record as a TelemetryFrame, and a bound on its size in a Telemetry message (bytes).

    The bound adds up the images' data instead of measuring the frame (``ByteSize()`` would encode its pixels
    once more): a few bytes over, never under.
    """
    frame = pb.TelemetryFrame(robot_time_s=f.robot_time_s, state=codec.to_tensor(f.state, 'float32'),
                              hold=f.hold, clamped=f.clamped, grid_index=f.grid_index,
                              step_start=f.step_start, step_end=f.step_end, hold_reason=f.hold_reason)
    if f.action is not None:
        frame.action.CopyFrom(codec.to_tensor(f.action, 'float32'))
    if f.policy_action is not None:
        frame.policy_action.CopyFrom(codec.to_tensor(f.policy_action, 'float32'))
    if f.pieces is not None and f.piece_share is not None:
        frame.pieces.CopyFrom(codec.to_tensor(f.pieces, 'float32'))
        frame.piece_share.extend(float(x) for x in f.piece_share)
    size = frame.ByteSize()
    images: Mapping[str, ImageLike] = f.images
    if images and fit is not None:
        try:
            images = fit(images)
        except SequenceAIError as exc:
            problems.append(f'CONTRACT_VIOLATION: {exc}')
            images = {}
    for key in order + sorted(k for k in images if k not in order):
        if key in images:
            try:
                image = codec.encode_image(key, images[key], 'jpeg')
            except SequenceAIError as exc:
                problems.append(f'CONTRACT_VIOLATION: {exc}')
                continue
            frame.images.append(image)
            size += len(image.data) + len(image.key) + len(image.encoding) + _IMAGE_OVERHEAD
    return frame, size + 6   # the frame's own tag and length in Telemetry


def pack_telemetry(frames: list[TelemetrySample], contract: Contract, fit: _FitFrames | None = None,
                   limit: int | None = None) -> TelemetryPacking:
    """Pack telemetry records into messages of at most ``limit`` bytes; images fitted (``fit``), then JPEG.

    Every camera the robot observed goes, not only those the policy uses (the contract's first): a dataset
    captured for fine-tuning keeps the robot's cameras even when the current policy ignores them. Records
    go in order, as many per message as fit (a record that does not fit beside the ones before starts the
    next message, so a large one goes on its own). A record that does not fit even alone stops the packing
    there (:attr:`TelemetryPacking.over_limit`).

    :param limit: the largest message (bytes, an EpisodeRequest), :meth:`Contract.receive_bytes`; None: one
        message, whatever its size.
    """
    problems: list[str] = []
    order = [c.key for c in contract.observation.cameras]
    out = TelemetryPacking([], problems)
    room = None if limit is None else limit - _MESSAGE_OVERHEAD
    current, used = pb.Telemetry(), 0
    for f in frames:
        frame, size = _pack_frame(f, order, fit, problems)
        if room is not None and size > room:
            n = len(frame.images)
            out.over_limit = (f'a capture record of {size} bytes (robot time {f.robot_time_s:.3f} s, {n} camera '
                              f'frame{"" if n == 1 else "s"}) is over the worker\'s {limit}-byte message limit')
            break
        if room is not None and current.frames and used + size > room:
            out.messages.append(current)
            current, used = pb.Telemetry(), 0
        current.frames.append(frame)
        used += size
    if current.frames or (not out.messages and not out.over_limit):
        out.messages.append(current)
    return out


def _pack_telemetry(frames: list[TelemetrySample], contract: Contract,
                    fit: _FitFrames | None = None) -> tuple[pb.Telemetry, list[str]]:
    """Pack telemetry records into one message, whatever its size (:func:`pack_telemetry` without a limit).

    :returns: the message, and why each frame that could not be fitted was left out of it.
    """
    packed = pack_telemetry(frames, contract, fit)
    return packed.messages[0], packed.problems


class CaptureReport:
    """What became of an episode's capture telemetry on the robot's side, and what the worker said of it.

    Written by gRPC's request-consumer thread (packing) and ``seq-recv`` (EpisodeEnded); read at the end.
    """

    def __init__(self) -> None:
        #: telemetry records not sent: the send queue was full
        self.dropped = 0
        #: camera frames this client could not fit, and frames the worker's capture refused (EpisodeEnded)
        self.rejected = 0
        #: the first of those refusals
        self.rejected_first = ''
        #: why this episode is not captured, or not kept: the robot stopped its capture (a record over the
        #: worker's message limit), or the worker said so at the end (a store write failed); '' otherwise
        self.capture_error = ''
        #: True once the robot stopped its capture: no more telemetry is sent for the episode
        self.stopped = False

    def stop(self, why: str) -> None:
        """Stop the episode's capture on the robot's side, for ``why``: nothing more is sent."""
        if not self.stopped:
            self.stopped = True
            self.capture_error = self.capture_error or why
            LOG.warning('%s', why)

    def refused(self, problems: list[str]) -> None:
        """Count camera frames left out of a record (``problems``: why each)."""
        if problems:
            self.rejected += len(problems)
            self.rejected_first = self.rejected_first or problems[0]

    def ended(self, msg: pb.EpisodeEnded) -> None:
        """Add the worker's word at the episode's end (frames refused, why the episode was not kept)."""
        self.rejected += msg.telemetry_rejected
        self.rejected_first = self.rejected_first or msg.telemetry_error
        self.capture_error = self.capture_error or msg.capture_error


class SentBeforeStart:
    """What an episode's calls sent before the worker accepted it, kept to be sent again.

    A call the worker refuses before the episode starts (a draining replica) is opened again; the new call
    sends what the refused ones had sent. Once EpisodeStarted came nothing more is kept. Thread-safe: gRPC's
    request-consumer thread keeps and replays, ``seq-recv`` marks the start.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started = False
        self._sent: list[bytes | pb.EpisodeRequest] = []

    @property
    def started(self) -> bool:
        """True once EpisodeStarted came: the worker accepted the episode."""
        return self._started

    def keep(self, msg: bytes | pb.EpisodeRequest) -> None:
        """Keep a message sent on this call, while the episode has not started."""
        with self._lock:
            if not self._started:
                self._sent.append(msg)

    def again(self) -> list[bytes | pb.EpisodeRequest]:
        """What calls refused before the start sent, in order (a new call sends it first)."""
        with self._lock:
            return list(self._sent)

    def start(self) -> None:
        """EpisodeStarted came: forget what was kept, keep nothing more."""
        with self._lock:
            self._started = True
            self._sent.clear()


class EpisodeCall:
    """One Episode call: EpisodeStart, requests, telemetry and EpisodeEnd out; replies to callbacks.

    :param conn: the connection.
    :param deployment: sent as ``x-deployment``.
    :param episode_id: sent as ``x-episode-id`` and in EpisodeStart.
    :param instruction: EpisodeStart's instruction.
    :param contract: for packing observations.
    :param on_chunk: called on ``seq-recv`` with each ActionChunk.
    :param on_error: called once with the typed error when the stream fails (not after :meth:`close`).
    :param on_started: called with EpisodeStarted (capture flags).
    :param fit_images: fits an observation's images to the contract (on gRPC's request thread, before encoding).
    :param fit_frames: fits a telemetry record's camera frames the same way (capture keeps what the policy saw).
    :param on_not_ready: called on ``seq-recv`` with a request's id and the worker's NotReady when it carries
        ``retry_after_s`` (the deployment loads); True: a wait, the stream goes on; False (or no callback):
        the stream fails with it (``on_error``).
    """

    def __init__(self, conn: Connection, deployment: str, episode_id: str, instruction: str, contract: Contract,
                 on_chunk: Callable[[pb.ActionChunk], None], on_error: Callable[[SequenceAIError], None],
                 on_started: Callable[[pb.EpisodeStarted], None], client_id: str = '',
                 fit_images: Callable[[Observation], Observation] | None = None,
                 fit_frames: _FitFrames | None = None,
                 on_not_ready: Callable[[int, NotReady], bool] | None = None) -> None:
        self._on_not_ready = on_not_ready
        self._fit = fit_images or (lambda obs: obs)
        self._fit_frames = fit_frames
        self.conn, self.deployment, self.episode_id, self.contract = conn, deployment, episode_id, contract
        self._start = pb.EpisodeStart(episode_id=episode_id, instruction=instruction, client_id=client_id)
        self._on_chunk, self._on_error, self._on_started = on_chunk, on_error, on_started
        self._outbox: queue.Queue[_Outgoing | _Signal] = queue.Queue(maxsize=256)
        self._stop = threading.Event()
        self._closing = threading.Event()
        self.ended = threading.Event()
        self.captured = False
        self._call_lock = threading.Lock()
        self._call: grpc.Call | None = None
        #: the capture telemetry's fate: dropped, refused, stopped over the message limit, not kept
        self.report = CaptureReport()
        #: the worker's refusal of the last call while the episode has not started (a draining replica, opened
        #: again until DRAIN_RETRY_S); None once it started, or when none was refused
        self.refusal: SequenceAIError | None = None
        tag = episode_id[:24]
        self._reader = threading.Thread(target=self._read_loop, name=f'seq-recv-{tag}', daemon=True)
        self._before_start = SentBeforeStart()   # sent on calls the worker refused before the start: sent again
        #: the episode's trace (its span, one per request) when this process traces, else None (costs nothing)
        self.trace = (tracing.EpisodeTrace(tracing.TRACER, episode_id, deployment)
                      if tracing.TRACER is not None else None)

    def start(self) -> None:
        """Start ``seq-recv``, which opens the call (gRPC then starts its request-consumer thread)."""
        self._reader.start()

    @property
    def dropped_telemetry(self) -> int:
        """Telemetry records not sent because the send queue was full."""
        return self.report.dropped

    @property
    def telemetry_rejected(self) -> int:
        """Camera frames this client could not fit, and telemetry frames the worker's capture refused."""
        return self.report.rejected

    @property
    def telemetry_error(self) -> str:
        """The first of those refusals (``"CONTRACT_VIOLATION: <why>"``), '' when none."""
        return self.report.rejected_first

    @property
    def capture_error(self) -> str:
        """Why this episode's capture stopped or was not kept (the robot's limit, the worker's store), or ''."""
        return self.report.capture_error

    # -- control side (never blocks) ---------------------------------------------------------------

    def send_request(self, req: OutRequest) -> None:
        """Enqueue an observation request for packing and sending."""
        try:
            self._outbox.put_nowait(req)
        except queue.Full:
            self._fail(ConnectionLost('send queue full: the worker stopped reading'))

    def send_telemetry(self, frames: list[TelemetrySample]) -> None:
        """Enqueue a telemetry batch; dropped (and counted) if the queue is full, or once capture stopped."""
        if self.report.stopped:
            return
        try:
            self._outbox.put_nowait(frames)
        except queue.Full:
            self.report.dropped += len(frames)

    def close(self, end: pb.EpisodeEnd | None, timeout: float = 2.0) -> bool:
        """Send EpisodeEnd (when given), wait up to ``timeout`` for EpisodeEnded, then stop and join.

        :returns: True when the worker confirmed the end.
        """
        self._closing.set()
        if end is not None and not self._stop.is_set():
            try:
                self._outbox.put(end, timeout=timeout)
            except queue.Full:
                pass
            self.ended.wait(timeout)
        self._stop.set()
        try:
            self._outbox.put_nowait(_Signal.CLOSE)
        except queue.Full:
            pass                      # the request iterator also ends on _stop
        with self._call_lock:
            if self._call is not None and not self.ended.is_set():
                self._call.cancel()
        if self._reader.is_alive() and self._reader is not threading.current_thread():
            self._reader.join(timeout)
        if self.trace is not None:
            self.trace.end(end.reason if end is not None else 'closed')
        return self.ended.is_set()

    # -- threads ----------------------------------------------------------------------------------

    def _fail(self, error: SequenceAIError) -> None:
        if not self._closing.is_set() and not self._stop.is_set():
            self._stop.set()
            self._on_error(error)

    def _pack(self, item: _Outgoing) -> list[bytes | pb.EpisodeRequest]:
        """The messages of one outbox item: one, or none or several for a telemetry batch.

        A telemetry batch goes on as many messages as the worker's limit (:meth:`Contract.receive_bytes`)
        needs; a record over that limit alone stops the episode's capture (:meth:`CaptureReport.stop`): it and
        every later record stay here, EpisodeEnd tells the worker to keep none of the episode, and the run
        goes on.
        """
        if isinstance(item, OutRequest):
            return [observation_request_bytes(
                self._fit(item.obs), self.contract, episode_id=self.episode_id, request_id=item.request_id,
                history=[self._fit(h) for h in item.history], chunk_tail=item.chunk_tail,
                expected_delay_actions=item.expected_delay_actions, last_action=item.last_action,
                observation_step=item.observation_step, tail_request_id=item.tail_request_id,
                trace_context=self.trace.request(item.request_id) if self.trace is not None else '')]
        if isinstance(item, pb.EpisodeEnd):
            msg = pb.EpisodeRequest()
            msg.end.CopyFrom(item)
            if self.report.stopped:
                msg.end.capture_error = self.report.capture_error
            return [msg]
        if self.report.stopped:
            return []
        packed = pack_telemetry(item, self.contract, self._fit_frames, self.contract.receive_bytes())
        self.report.refused(packed.problems)
        if packed.over_limit:
            self.report.stop(f'capture of episode {self.episode_id!r} stopped: {packed.over_limit}; the run goes on '
                             'uncaptured and the worker keeps none of it (send fewer or smaller camera frames: '
                             'troubleshooting, CaptureError)')
        return [pb.EpisodeRequest(telemetry=telemetry) for telemetry in packed.messages]

    def _requests(self, refused: threading.Event) -> Iterator[bytes | pb.EpisodeRequest]:
        """One call's requests: EpisodeStart, what refused calls sent before (again), then the outbox.

        Until the worker accepts the episode, what is sent is kept, so that a call opened again after a
        refusal (:meth:`_read_loop`) sends it again; ``refused`` ends this call's side (the robot's close
        that the worker waits for after a refusal).
        """
        yield pb.EpisodeRequest(start=self._start)
        yield from self._before_start.again()
        while True:
            try:
                item = self._outbox.get(timeout=0.1)
            except queue.Empty:
                if self._stop.is_set() or refused.is_set():
                    return
                continue
            if item is _Signal.CLOSE:
                return
            if item is _Signal.WAKE:
                if refused.is_set():
                    return
                continue
            try:
                msgs = self._pack(item)
            except SequenceAIError as exc:
                self._fail(exc)
                return
            for msg in msgs:
                self._before_start.keep(msg)
            if refused.is_set():   # this call is over: the next one sends it
                return
            yield from msgs
            if isinstance(item, pb.EpisodeEnd):
                return

    def _read_loop(self) -> None:
        """Open the call and read its replies; open it again (same id) while the worker refuses it as draining.

        A draining replica refuses a new episode before it starts (:class:`~sequence_ai_ros.exceptions.Draining`);
        the call is opened again with the same ``x-episode-id`` after a pause, so a balancer, which no longer
        sends that id to the draining replica, hashes it to another one, up to :data:`DRAIN_RETRY_S` in all.
        """
        deadline = time.monotonic() + DRAIN_RETRY_S
        for attempt in itertools.count(1):
            refusal = self._one_call()
            if refusal is None:
                return
            self.refusal = refusal
            pause = min(DRAIN_RETRY_PAUSE_S * attempt, 1.0)
            if (not isinstance(refusal, Draining) or time.monotonic() + pause > deadline
                    or self._stop.wait(pause)):
                self._fail(refusal)
                return
            LOG.info('episode %s: %s; opening it again (attempt %d)', self.episode_id, refusal, attempt + 1)

    def _one_call(self) -> SequenceAIError | None:
        """Run one call of the episode; return the worker's refusal of it (None: served, or failed as told)."""
        md = (*self.conn.metadata, (EPISODE_ID_METADATA, self.episode_id), (DEPLOYMENT_METADATA, self.deployment))
        if self.trace is not None:     # W3C trace context: the worker's spans continue the episode's trace
            md = (*md, (tracing.TRACEPARENT, self.trace.traceparent))
        refused = threading.Event()
        refusal: SequenceAIError | None = None
        with self._call_lock:
            if self._stop.is_set():
                return None
            call = self._call = self.conn.episode_stream(self._requests(refused), metadata=md)
        try:
            for reply in call:
                kind = reply.WhichOneof('kind')
                if kind == 'chunk':
                    if self.trace is not None:
                        self.trace.answered(reply.chunk.request_id)
                    self._on_chunk(reply.chunk)
                elif kind == 'started':
                    self._before_start.start()
                    self.refusal = None
                    self._on_started(reply.started)
                elif kind == 'error':
                    error = errors.from_error(reply.error)
                    if self.trace is not None and reply.error.request_id:
                        self.trace.answered(reply.error.request_id, str(error))
                    if reply.error.refusal and not self._before_start.started:   # nothing ran: close our side
                        refusal = error
                        refused.set()
                        with contextlib.suppress(queue.Full):
                            self._outbox.put_nowait(_Signal.WAKE)
                    elif not (isinstance(error, NotReady) and error.retry_after_s > 0 and reply.error.request_id
                              and self._on_not_ready is not None
                              and self._on_not_ready(reply.error.request_id, error)):
                        self._fail(error)
                elif kind == 'ended':
                    self.captured = reply.ended.captured
                    self.report.ended(reply.ended)
                    self.ended.set()
            if refusal is not None:
                return refusal
            if not self.ended.is_set():
                self._fail(ConnectionLost(f'the worker closed episode {self.episode_id!r} without EpisodeEnded'))
        except grpc.RpcError as exc:
            if refusal is not None:   # the refusal came first: the call's end does not matter
                return refusal
            error = _stream_error(exc)
            if isinstance(error, CaptureError):   # said in the outcome too, when it came as the episode ended
                self.report.stop(str(error))
            self._fail(error)
        except Exception as exc:  # a bug in a callback must not kill the episode silently
            LOG.exception('episode %s: reader failed', self.episode_id)
            self._fail(ConnectionLost(f'episode reader failed: {type(exc).__name__}: {exc}'))
        return None


def _stream_error(exc: grpc.RpcError) -> SequenceAIError:
    """The typed error of a failed Episode call; a message over the worker's transport limit is not Overloaded.

    gRPC reports a message larger than the receiver's limit as RESOURCE_EXHAUSTED (``Received message larger
    than max (N vs. M)``), which is otherwise the worker's OVERLOADED. This client packs telemetry within the
    limit its contract implies; a worker with a smaller one (an older release) still refuses a large message:
    that is a :class:`~sequence_ai_ros.exceptions.CaptureError` naming both sizes, never "add replicas".
    """
    details = str(exc.details() or '') if hasattr(exc, 'details') else ''
    if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and 'larger than max' in details:
        return CaptureError(f'the worker refused a message over its message limit ({details}): a capture record '
                            'with large camera frames, sent to a worker that accepts less than this client packs '
                            'for (an older release?); the stream ended. Upgrade the worker, or capture without '
                            'images (seq policy capture NAME --no-images) or with smaller camera frames')
    return errors.from_rpc_error(exc)
