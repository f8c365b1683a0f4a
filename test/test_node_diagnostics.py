"""Diagnostics that tell the truth: WARN/ERROR on tick jitter, skipped ticks, underruns, clamps, dropped telemetry.

Each level is driven by an injected fault or load on the real part that measures it: a control thread
(:class:`TickThread`) with stalls in its callback, the safety filter on out-of-limit commands, a real
node against a worker slower than its chunks (underruns), and a real client episode whose telemetry
cannot be queued (dropped capture frames). Thresholds are the ``diagnostics.*`` parameters.
"""

from __future__ import annotations

import queue
import threading

import numpy as np
import pytest
from test_node_support import POLICIES, Probe, node_log, node_params, spawn_worker, wait_for
from test_node_support import spawn_node as spawn

from sequence_ai_ros.node.config import CommandConfig, DiagnosticsConfig, JointsConfig, NodeConfig, SafetyConfig
from sequence_ai_ros.node.diagnostics import ERROR, OK, WARN, Health
from sequence_ai_ros.node.safety import SafetyFilter
from sequence_ai_ros.node.tick import TickThread

CFG = DiagnosticsConfig(window_s=10.0, jitter_warn_ms=5.0, jitter_error_ms=20.0, ticks_skipped_warn=1,
                        ticks_skipped_error=3, underrun_warn=0.01, underrun_error=0.2, clamp_warn=0.0,
                        clamp_error=0.5, dropped_telemetry_warn=1, dropped_telemetry_error=10)


def test_an_idle_window_is_ok_and_faults_age_out_of_the_window():
    health = Health(CFG)
    window = health.update(0.0, {})
    assert health.control(0.3, window) == (OK, []) and health.episode(window) == (OK, [])
    window = health.update(1.0, {'ticks_skipped': 4, 'dropped_telemetry': 2})
    assert health.control(0.3, window)[0] == ERROR and health.episode(window)[0] == WARN
    window = health.update(20.0, {'ticks_skipped': 4, 'dropped_telemetry': 2})    # nothing new for 19 s
    assert health.control(0.3, window)[0] == OK and health.episode(window)[0] == OK
    window = health.update(21.0, {'ticks_skipped': 1})      # a new control thread: its count restarts
    assert window['ticks_skipped'] == 1


@pytest.mark.parametrize('warn, error', [('jitter_warn_ms', 'jitter_error_ms'), ('clamp_warn', 'clamp_error'),
                                         ('ticks_skipped_warn', 'ticks_skipped_error')])
def test_a_warn_threshold_above_its_error_threshold_is_refused(warn, error):
    from sequence_ai_ros.exceptions import ConfigError

    with pytest.raises(ConfigError, match=f'diagnostics.{warn}'):
        DiagnosticsConfig(**{warn: 0.6, error: 0.5})


def test_tick_jitter_and_ticks_skipped_escalate_under_injected_load():
    stalls = threading.Event()
    done = threading.Event()
    calls = []

    def loaded(now: float) -> None:           # every 4th tick stalls 3.5 periods: late ticks and skipped ones
        calls.append(now)
        if len(calls) % 4 == 0:
            stalls.wait(0.035)
        if len(calls) >= 40:
            done.set()

    tick = TickThread(0.01, loaded, name='test-loaded')
    tick.start()
    assert done.wait(20.0)
    tick.stop()
    health = Health(CFG)
    health.update(0.0, {})
    window = health.update(1.0, {'ticks_skipped': tick.skipped})
    level, reasons = health.control(tick.jitter_ms()[1], window)
    assert tick.skipped >= 3 and tick.jitter_ms()[1] > 20.0
    assert level == ERROR, reasons
    assert any('tick jitter p99' in r and 'ERROR' in r for r in reasons), reasons
    assert any('skipped ticks' in r for r in reasons), reasons
    relaxed = Health(DiagnosticsConfig(jitter_warn_ms=10.0, jitter_error_ms=1000.0, ticks_skipped_warn=1,
                                       ticks_skipped_error=1000))
    relaxed.update(0.0, {})
    level, reasons = relaxed.control(tick.jitter_ms()[1], relaxed.update(1.0, {'ticks_skipped': tick.skipped}))
    assert level == WARN, reasons


def test_clamp_rate_escalates_with_the_share_of_clamped_commands():
    safety = SafetyFilter(SafetyConfig(lower_limits=(-1.0,), upper_limits=(1.0,)), ['a'])
    health = Health(CFG)
    health.update(0.0, {})
    for v in [0.0] * 9 + [2.0]:                       # one command in ten beyond its limit
        safety.check(np.array([v]), None)
    counters = {'commands_checked': safety.checked, 'commands_clamped': safety.clamped_commands}
    level, reasons = health.control(0.1, health.update(1.0, counters))
    assert level == WARN and '10% of commands clamped' in reasons[0], reasons
    for v in [2.0] * 20:                              # then most of them
        safety.check(np.array([v]), None)
    counters = {'commands_checked': safety.checked, 'commands_clamped': safety.clamped_commands}
    level, reasons = health.control(0.1, health.update(2.0, counters))
    assert level == ERROR, reasons


class _TelemetryRefused(queue.Queue):
    """The episode stream's send queue as a worker that stopped reading leaves it: telemetry finds it full."""

    def put_nowait(self, item):  # noqa: ANN001, ANN201
        if isinstance(item, list):
            raise queue.Full
        return super().put_nowait(item)


@pytest.mark.ros
def test_dropped_telemetry_is_counted_from_the_real_client_and_escalates(tmp_path):
    from sensor_msgs.msg import JointState

    from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
    from sequence_ai_ros.node.controller_commands import CommandInterface
    from sequence_ai_ros.node.observation import ObservationAssembler
    from sequence_ai_ros.node.runner import Runner, episode_settings
    from sequence_ai_ros.worker import serve_policy_file

    names = ('j0', 'j1', 'j2', 'j3')
    capture = tmp_path / 'capture'
    save_settings(capture / 'ramp', CaptureSettings(rate=1.0, enabled=True))
    with serve_policy_file(POLICIES / 'node_ramp.py', 'ramp', capture_root=capture, names=list(names),
                           step=0.001) as server:
        cfg = NodeConfig(model='ramp', endpoint=f'127.0.0.1:{server.port}', joints=JointsConfig(names=names),
                         command=CommandConfig(controller='arm'))
        commands = CommandInterface(cfg.command, cfg.command_joint_names, cfg.period_s)
        safety = SafetyFilter(cfg.safety, cfg.command_joint_names)
        assembler = ObservationAssembler(names, 0.5, {}, joints_source='joint_states')
        runner = Runner(cfg, commands, safety, assembler)
        runner.accepting = True
        assert runner.connect_now() == ''
        runner.start(episode_settings('reach', 10.0))
        import time

        def tick_for(seconds: float) -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                now = time.monotonic()
                assembler.put_joints(JointState(name=list(names), position=[0.1, 0.2, 0.3, 0.4]), now)
                runner.tick(now)
                runner.session_step(now)
                time.sleep(0.02)

        tick_for(0.5)
        episode = runner.policy._episode
        assert wait_for(lambda: episode.telemetry is not None, 5), 'capture did not start'
        episode.stream._outbox = _TelemetryRefused(maxsize=256)    # the injected fault
        tick_for(2.0)
        dropped = runner.dropped_telemetry()
        runner.close()
    assert dropped > 0
    health = Health(CFG)
    health.update(0.0, {})
    level, reasons = health.episode(health.update(1.0, {'dropped_telemetry': dropped}))
    assert level in (WARN, ERROR) and f'{dropped} capture frames dropped' in reasons[0], reasons


class _OneFrameCorrupted(queue.Queue):
    """The episode stream's send queue with one telemetry frame corrupted on its way (a NaN state)."""

    corrupted = 0

    def put_nowait(self, item):  # noqa: ANN001, ANN201
        if isinstance(item, list) and item and not self.corrupted:
            import dataclasses

            bad = np.array(item[0].state, np.float32)
            bad[0] = np.nan
            item = [dataclasses.replace(item[0], state=bad), *item[1:]]
            self.corrupted = 1
        return super().put_nowait(item)


@pytest.mark.ros
def test_telemetry_the_worker_refuses_is_counted_logged_and_escalates(tmp_path):
    """A frame the worker's capture refuses costs only itself: the episode is kept, the node counts it."""
    from sensor_msgs.msg import JointState

    from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
    from sequence_ai_ros.capture.store import CaptureStore
    from sequence_ai_ros.node import diagnostics
    from sequence_ai_ros.node.controller_commands import CommandInterface
    from sequence_ai_ros.node.observation import ObservationAssembler
    from sequence_ai_ros.node.runner import Runner, episode_settings
    from sequence_ai_ros.worker import serve_policy_file

    names = ('j0', 'j1', 'j2', 'j3')
    capture = tmp_path / 'capture'
    save_settings(capture / 'ramp', CaptureSettings(rate=1.0, enabled=True))
    logged: list[str] = []
    with serve_policy_file(POLICIES / 'node_ramp.py', 'ramp', capture_root=capture, names=list(names),
                           step=0.001) as server:
        cfg = NodeConfig(model='ramp', endpoint=f'127.0.0.1:{server.port}', joints=JointsConfig(names=names),
                         command=CommandConfig(controller='arm'))
        commands = CommandInterface(cfg.command, cfg.command_joint_names, cfg.period_s)
        safety = SafetyFilter(cfg.safety, cfg.command_joint_names)
        assembler = ObservationAssembler(names, 0.5, {}, joints_source='joint_states')
        runner = Runner(cfg, commands, safety, assembler, log=lambda level, text: logged.append(f'{level}: {text}'))
        runner.accepting = True
        assert runner.connect_now() == ''
        runner.start(episode_settings('reach', 10.0))
        import time

        def tick_for(seconds: float) -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                now = time.monotonic()
                assembler.put_joints(JointState(name=list(names), position=[0.1, 0.2, 0.3, 0.4]), now)
                runner.tick(now)
                runner.session_step(now)
                time.sleep(0.02)

        tick_for(0.5)
        episode = runner.policy._episode
        assert wait_for(lambda: episode.telemetry is not None, 5), 'capture did not start'
        outbox = episode.stream._outbox = _OneFrameCorrupted(maxsize=256)    # the injected fault
        tick_for(1.0)
        assert outbox.corrupted
        eid = runner.request_end('completed')
        runner.session_step(time.monotonic())           # the session thread's work: ends the episode
        result = runner.wait(eid, 10)
        runner.close()
    assert result.telemetry_rejected == 1, result
    assert 'nan' in result.telemetry_error.lower() or 'finite' in result.telemetry_error.lower(), result
    assert runner.telemetry_rejected == 1
    assert any('refused 1 capture frames' in line for line in logged), logged
    kept = CaptureStore(capture / 'ramp', 'ramp').episodes()
    assert len(kept) == 1, 'the episode must be kept without the bad frame'
    health = Health(CFG)
    health.update(0.0, {})
    level, reasons = health.episode(health.update(1.0, {'telemetry_rejected': runner.telemetry_rejected}))
    assert level == WARN and '1 capture frames refused by the worker' in reasons[0], reasons
    assert 'telemetry_rejected' in diagnostics.COUNTERS


@pytest.mark.ros
@pytest.mark.slow
def test_a_worker_slower_than_its_chunks_turns_the_episode_status_to_error(tmp_path, processes, rclpy_context):
    """Injected load on the policy side: 0.3 s inference for chunks covering 0.25 s: the node underruns."""
    from diagnostic_msgs.msg import DiagnosticStatus
    from std_msgs.msg import Float64MultiArray

    names = ['frame', 'request']
    port = spawn_worker(processes, POLICIES / 'client_latency.py', 'slow', mean_s=0.3)
    probe = Probe(rclpy_context, Float64MultiArray, '/arm/commands')
    try:
        params = node_params(tmp_path, model='slow', endpoint=f'127.0.0.1:{port}', diagnostics_rate_hz=5.0,
                             status_rate_hz=10.0, **{'joints.names': names, 'command.controller': 'arm',
                                                     'diagnostics.underrun_error': 0.2})
        proc = spawn(processes, tmp_path / 'node.log', params)
        probe.publish_joints(names)
        assert probe.wait_connected(), node_log(proc)
        handle = probe.send_goal(instruction='slow', max_seconds=4.0)

        def episode_error():
            for arr in reversed(list(probe.diagnostics)):
                for st in arr.status:
                    if st.name == 'policy_node: episode' and st.level == DiagnosticStatus.ERROR:
                        return st
            return None
        status = wait_for(episode_error, 20)
        result = probe.result(handle)
    finally:
        probe.close()
    assert status is not None, node_log(proc)
    assert 'in underrun' in status.message, status.message
    assert result.underruns > 0
