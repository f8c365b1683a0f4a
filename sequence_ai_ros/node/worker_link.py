"""The runner's connection to the worker, ROS-free: the client's Policy, its contract and its readiness.

:class:`RunnerPolicy` lists what the node uses of the client's :class:`~sequence_ai_ros.client.policy.Policy`;
:class:`WorkerLink` connects (blocking, from configure or the session thread), retries every second while
disconnected, and polls readiness every second once connected.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from sequence_ai_ros.client.labels import LabelResult
from sequence_ai_ros.client.outcome import RunOutcome
from sequence_ai_ros.client.session import ENDPOINT_HINT
from sequence_ai_ros.client.settings import EpisodeSettings
from sequence_ai_ros.exceptions import SequenceAIError
from sequence_ai_ros.node.config import NodeConfig
from sequence_ai_ros.protocol.contract import Contract
from sequence_ai_ros.protocol.types import Action, Observation


def node_hint(message: str) -> str:
    """The client's error message with its hint for connect() callers replaced by the node's endpoint parameter."""
    return message.replace(ENDPOINT_HINT, 'set the node parameter endpoint (-p endpoint:=HOST:PORT, or the launch '
                                          'argument endpoint:=HOST:PORT), or $SEQ_ENDPOINT where it is empty')


class RunnerPolicy(Protocol):
    """What the node's runner uses of the client's :class:`~sequence_ai_ros.client.policy.Policy`."""

    #: the deployment's contract (read once connected)
    contract: Contract
    #: requests in flight at most (the node sets its ``max_in_flight`` parameter)
    max_in_flight: int

    def ready(self) -> tuple[bool, float]:
        """(ready, eta_seconds), without blocking long (the session thread polls it)."""

    def begin_episode(self, *, episode_id: str | None = None, settings: EpisodeSettings | None = None) -> str:
        """Open an episode with ``settings``; return its id (blocking)."""

    def next_action(self, observation: Observation, now: float | None = None, *,
                    grid_index: int | None = None) -> Action | None:
        """The action for the control tick at ``now`` serving deadline ``grid_index`` (never blocks)."""

    def report_command(self, commanded: Any, clamped: bool = False, *, hold_reason: str = '') -> None:
        """Complete the tick's record with what the robot commanded (None: it held, ``hold_reason`` why)."""

    def start_ticks(self, grid_index: int) -> None:
        """Count the open episode's ticks from the control deadline after ``grid_index`` (its start)."""

    def hold_tick(self, grid_index: int | None, hold_reason: str) -> bool:
        """Count a control tick that held without asking for an action (``ticks_held``); never blocks."""

    def end_ticks(self, grid_index: int) -> None:
        """Count the deadlines up to ``grid_index``, the episode's last, that no tick served as skipped."""

    def episode_outcome(self) -> RunOutcome | None:
        """None while the episode runs; its outcome once it finished."""

    def end_episode(self, reason: str = 'completed') -> RunOutcome | None:
        """End the open episode (blocking); return its outcome."""

    def interrupt(self) -> None:
        """Stop the running episode between two actions (any thread, never blocks)."""

    def label(self, success: bool, notes: str = '', episode_id: str | None = None) -> LabelResult:
        """Store a label for an episode on the worker (blocking)."""

    def stats(self) -> Mapping[str, Any]:
        """Live numbers of the current or last episode (buffer_s, chunks, underruns, the tick counts...)."""

    def chunk_horizon(self) -> tuple[int, float, float, Any] | None:
        """The playing chunk: (number, next row position, dt (s), float32 (T, D) rows), or None."""

    def close(self) -> None:
        """End any open episode and close the channel."""


class WorkerLink:
    """The connection to the worker: its state for ~/status and /diagnostics, the Policy once connected.

    ``state`` is 'connecting' (nothing tried yet), 'unconfigured' (no model), 'disconnected' (``error`` says
    why), 'connected', then 'warming' or 'ready' by the readiness polls.

    :param cfg: the node configuration (model, endpoint, token, connect_timeout_s, max_in_flight).
    :param connect: ``connect(model, endpoint=, token=, timeout=)`` returning a Policy; defaults to
        :func:`sequence_ai_ros.client.connect`.
    :param on_connected: called with the contract once connected, before the Policy is made available.
    :param log: ``log(level, message)``.
    """

    def __init__(self, cfg: NodeConfig, connect: Callable[..., RunnerPolicy] | None,
                 on_connected: Callable[[Contract], None], log: Callable[[str, str], None]) -> None:
        self.cfg = cfg
        self._connect = connect
        self._on_connected = on_connected
        self._log = log
        self.policy: RunnerPolicy | None = None
        self.contract: Contract | None = None
        self.state = 'connecting'
        self.error = ''
        self.ready = False
        self._next_connect = 0.0
        self._next_ready_poll = 0.0

    def poll(self, now: float) -> None:
        """The session thread's part at ``now`` (monotonic s): connect, or poll readiness (each once a second)."""
        if self.policy is None:
            if now >= self._next_connect:
                self.connect()
                self._next_connect = now + 1.0
        elif now >= self._next_ready_poll:
            self._next_ready_poll = now + 1.0
            try:
                self.ready, _eta_s = self.policy.ready()
                self.state, self.error = ('ready' if self.ready else 'warming'), ''
            except SequenceAIError as exc:
                self.ready, self.state, self.error = False, 'disconnected', node_hint(str(exc))

    def connect_now(self) -> str:
        """Connect now (blocking, bounded by ``connect_timeout_s``); return '' or the error."""
        self.connect()
        self._next_connect = time.monotonic() + 1.0
        return '' if self.policy is not None else (self.error or self.state)

    def connect(self) -> None:
        """One connect attempt (blocking); its failure is kept in ``state`` and ``error``."""
        cfg = self.cfg
        if not cfg.model:
            self.state, self.error = 'unconfigured', 'parameter model is empty'
            return
        try:
            connect = self._connect
            if connect is None:
                from sequence_ai_ros.client import connect as client_connect

                connect = client_connect
            policy = connect(cfg.model, endpoint=cfg.endpoint, token=cfg.token or None,
                             timeout=cfg.connect_timeout_s)
            contract = policy.contract
            policy.max_in_flight = cfg.max_in_flight
        except (SequenceAIError, OSError) as exc:
            # the client's hint is for connect() callers; the node's endpoint is a parameter
            self.state, self.error = 'disconnected', node_hint(str(exc))
            return
        self.contract = contract
        self._on_connected(contract)
        self.policy = policy
        self.state, self.error = 'connected', ''
        self._log('info', f'connected to {cfg.model} at {cfg.endpoint}: {contract.action_space.value}, '
                          f'{contract.action_dim} dims, dt {contract.dt:.4f} s')

    def refused(self, error: str) -> None:
        """Say why the node refuses this worker (a link never connected: configure's contract check failed)."""
        self.state, self.error = 'disconnected', error

    def not_connected(self) -> str:
        """Why there is no Policy: the error, else the state."""
        return self.error or self.state

    def close(self) -> None:
        """Close the Policy (blocking); a failure is logged."""
        if self.policy is not None:
            try:
                self.policy.close()
            except SequenceAIError as exc:
                self._log('warn', f'close: {exc}')
