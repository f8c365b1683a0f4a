"""The robot-side client: a ROS-free chunk engine that drives a control loop from a remote policy.

Public API (re-exported as ``sequence_ai_ros.connect`` and by the ``sequence_ai`` alias):
:func:`connect` -> :class:`Policy` (``act``, ``run``, ``begin_episode``/``next_action``/``end_episode``,
``interrupt``, ``label``, ``ready``, ``wait_until_ready``, ``stats``), :class:`RunOutcome`,
:class:`Observation`, :class:`Action`, :class:`ActionSpace`; ``label`` returns a :class:`LabelResult`.

Modules, one concept each: :mod:`.policy` (the handle), :mod:`.settings` (EpisodeSettings, the one
definition of the episode options), :mod:`.driving` (the paced act/run loop), :mod:`.engine` (one
episode's front: ticks, chunks, limits, the outcome) over its parts :mod:`.timeline` (control grid, spans,
Steps), :mod:`.player` (the live chunk, stale-action skip, aggregation, seams, holds), :mod:`.requests`
(prefetch and pipelined requests, warming) and :mod:`.tally` (chunks, underruns, seams), :mod:`.steps`
(one record per tick and the ledger that commits them), :mod:`.records`
(its requests and constants), :mod:`.resample` (reading a chunk at the caller's period; seam blending),
:mod:`.latency` (round-trip window, prefetch lead), :mod:`.sampling` (history and telemetry on the
policy's clocks), :mod:`.pacing` (absolute deadlines; the one-thread rule), :mod:`.stopping` (what
``interrupt()`` stops), :mod:`.session` (gRPC),
:mod:`.adapter` (images and state fitted to the contract, shared with the node), :mod:`.outcome`, :mod:`.labels`,
:mod:`.checks` (arguments and observations at the edge).

Failures: a bad observation is a ContractViolation (act/run: hold, reason 'validate'); the caller's own
code raising holds once, tells the worker 'error' and re-raises; a lost, erring or silent worker (no chunk
within the no-chunk deadline, ``chunk_timeout``) holds, then raises a typed error.

Threads: the caller's control thread runs act/run/next_action and never waits on the network. Per
episode, gRPC's request thread packs and sends and ``seq-recv-<id>`` reads; both are owned by the
episode's stream and joined (with a timeout) when the episode ends. All timing uses
``time.monotonic()`` on the robot; nothing is compared across hosts.
"""

from sequence_ai_ros.client.labels import LabelResult
from sequence_ai_ros.client.outcome import REASONS, RunOutcome
from sequence_ai_ros.client.policy import Policy, connect
from sequence_ai_ros.protocol.spaces import ActionSpace
from sequence_ai_ros.protocol.types import Action, Observation

__all__ = ['REASONS', 'Action', 'ActionSpace', 'LabelResult', 'Observation', 'Policy', 'RunOutcome', 'connect']
