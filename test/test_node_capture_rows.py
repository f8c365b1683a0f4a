"""Captured rows from the node's control ticks: real TickThread, in-process worker, capture on, rows as exported.

The node stamps each tick with its control deadline ``pacer.start_s + k * period``; capture and the
observation history sample those stamps on grids (client/sampling.py GridSampler) and rows.py maps them to
rows. Also joint_delta and joint_velocity exports (the increments and velocities the robot executed).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
from test_data_rows import _contract, _episode, _frame
from test_data_support import make_store
from test_node_support import RAMP

from sequence_ai_ros.datasets.rows import build_rows
from sequence_ai_ros.protocol.spaces import ActionSpace

pytestmark = [pytest.mark.ros]

NAMES = ('j0', 'j1', 'j2', 'j3')


def _run_node_episode(tmp_path, *, rate_hz: float, seconds: float, space: str = 'joint_absolute',
                      stalls: dict[int, float] | None = None, step: float = 0.001,
                      late: dict[int, float] | None = None, safety=None, toggle=None, prefetch=True):
    """A Runner ticked by a real TickThread against an in-process ramp worker; capture on with images.

    Returns (rows, ticks) where ticks is a list of (wake_time, stamp, command or None) per telemetry tick.
    """
    from sensor_msgs.msg import JointState

    from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
    from sequence_ai_ros.capture.store import CaptureStore
    from sequence_ai_ros.datasets.rows import build_rows
    from sequence_ai_ros.node.config import CameraConfig, CommandConfig, JointsConfig, NodeConfig, SafetyConfig
    from sequence_ai_ros.node.controller_commands import CommandInterface
    from sequence_ai_ros.node.observation import ObservationAssembler
    from sequence_ai_ros.node.runner import Runner, episode_settings
    from sequence_ai_ros.node.safety import SafetyFilter
    from sequence_ai_ros.node.tick import TickThread
    from sequence_ai_ros.protocol.spaces import ActionSpace
    from sequence_ai_ros.worker import serve_policy_file

    capture = tmp_path / 'capture'
    save_settings(capture / 'ramp', CaptureSettings(rate=1.0, enabled=True, images=True))
    img = np.zeros((48, 64, 3), np.uint8)
    with serve_policy_file(RAMP, 'ramp', capture_root=capture, names=list(NAMES), step=step, camera='cam',
                           camera_size=(64, 48), action_space=space) as server:
        cfg = NodeConfig(model='ramp', endpoint=f'127.0.0.1:{server.port}', control_rate_hz=rate_hz,
                         joints=JointsConfig(names=NAMES),
                         command=CommandConfig(controller='arm',
                                               kind='velocity' if 'velocity' in space else 'position'),
                         cameras=(CameraConfig(name='front', topic='/front/image_raw', key='cam'),),
                         safety=safety or SafetyConfig(lower_limits=(-5.0,) * 4, upper_limits=(5.0,) * 4))
        commands = CommandInterface(cfg.command, cfg.command_joint_names, cfg.period_s)
        runner = Runner(cfg, commands, SafetyFilter(cfg.safety, cfg.command_joint_names),
                        ObservationAssembler(NAMES, 0.5, {'cam': 0.5}, joints_source='joint_states'))
        runner.accepting = True
        assert runner.connect_now() == ''
        # the script below acts at given ticks (stalls, late wake-ups, a dry stretch): they must meet a serving
        # deployment, not an episode still holding while it loads (its own process)
        runner.policy.wait_until_ready(timeout=60)
        counter = [0]
        sent: list = []     # (wake, fresh, published command, grid index) per tick
        dstate = {'was_dry': False, 'ctl': None}

        def fn(now: float) -> None:
            runner.assembler.put_joints(JointState(name=list(NAMES), position=[0.1, 0.2, 0.3, 0.4]), now)
            counter[0] += 1
            frame = img.copy()
            frame[0, 0, 0] = counter[0] % 256
            runner.assembler.put_image('cam', lambda: frame, now)
            if late and counter[0] in late:      # the thread wakes this share of a period late (still its deadline)
                time.sleep(late[counter[0]] * cfg.period_s)
                now = time.monotonic()
            dry = bool(toggle) and counter[0] in toggle
            if not dry and dstate['was_dry']:      # policy_node: enabled:=true rebases on the controller's last
                runner.last_command = dstate['ctl']
                dstate['was_dry'] = False
            value = runner.tick(now, dry=dry)
            if dry:
                dstate['was_dry'] = True
            elif value is not None:
                dstate['ctl'] = np.array(value)
            sent.append((now, runner.last_action is not None and not dry,
                         None if (value is None or dry) else np.array(value), tick.current_index()))
            if stalls and counter[0] in stalls:
                time.sleep(stalls[counter[0]])      # the thread overruns (a stall): the next deadlines are skipped

        tick = TickThread(cfg.period_s, fn, name='brk-tick')
        tick.start()
        runner.grid = tick
        stop = threading.Event()

        def session() -> None:
            while not stop.is_set():
                runner.session_step(time.monotonic())
                stop.wait(0.02)

        st = threading.Thread(target=session, daemon=True)
        st.start()
        try:
            runner.start(episode_settings('reach', 30.0, prefetch=prefetch))
            time.sleep(seconds)
            eid = runner.request_end('completed')
            result = runner.wait(eid, 30)
        finally:
            stop.set()
            st.join(2)
            tick.stop()
            runner.close()
    assert result is not None
    [episode] = CaptureStore(capture / 'ramp', 'ramp').episodes()
    rows = build_rows(episode, 30.0, ActionSpace(space), 4, 4, ['cam'])
    return rows, result, tick, sent, episode


@pytest.mark.parametrize('uptime_s', [
    0.0,
    7 * 86400.0,   # a week of uptime: grid stamps carry float error of ulp(t)
])
def test_30hz_node_rows_each_show_their_own_ticks_camera_frame(tmp_path, monkeypatch, uptime_s):
    """A 30 Hz node against a 30 Hz policy: every tick is a row and carries the row's camera frame."""
    real = time.monotonic
    if uptime_s:
        def far() -> float:
            return real() + uptime_s

        monkeypatch.setattr(time, 'monotonic', far)
        from sequence_ai_ros.client.engine import EpisodeEngine  # its default clock was bound at import
        defaults = EpisodeEngine.__init__.__defaults__
        assert real in defaults, defaults
        monkeypatch.setattr(EpisodeEngine.__init__, '__defaults__',
                            tuple(far if d is real else d for d in defaults))
    rows, result, tick, _, _ = _run_node_episode(tmp_path, rate_hz=30.0, seconds=3.0)
    assert len(rows) > 60, len(rows)
    frames = rows.frame_ticks['cam']
    held = rows.held
    steps = np.diff(frames)
    both_fresh = ~held[1:] & ~held[:-1]
    bad = np.flatnonzero(both_fresh & (steps != 1))
    assert bad.size == 0, (f'{bad.size} of {int(both_fresh.sum())} consecutive fresh rows do not use their own '
                           f'tick\'s frame: rows {bad[:10].tolist()} steps {steps[bad[:10]].tolist()} '
                           f'(skipped ticks {tick.skipped})')


def test_joint_delta_node_export_rows_are_the_executed_increments(tmp_path):
    rows, result, tick, sent, _ = _run_node_episode(tmp_path, rate_hz=30.0, seconds=2.0, space='joint_delta')
    commands = np.array([v for _, fresh, v, _ in sent if fresh])
    assert len(commands) > 30
    # the node commanded 0.1.. + 0.001 per step (node_ramp step=0.001 increments): each row is the increment
    # the robot executed (not the integrated target), and the rows sum to the commanded path
    fresh = rows.action[~rows.held]
    np.testing.assert_allclose(fresh, np.float32(0.001), rtol=0, atol=1e-7)
    assert np.all(rows.action[rows.held] == 0), 'a held row adds nothing'
    path = commands[-1] - np.array([0.1, 0.2, 0.3, 0.4])
    np.testing.assert_allclose(rows.action.astype(np.float64).sum(0), path, atol=1e-5)


START = np.array([0.1, 0.2, 0.3, 0.4], np.float32)   # the ramp's robot state before the first action


def run_and_export(tmp_path, space: str, max_actions: int, overruns: dict[int, float] | None = None):
    """run() a captured ramp (robot state = the last action received) and build its exported rows.

    :param overruns: act() call number -> how many 30 Hz periods that call sleeps (an overrun).
    :returns: (rows, float32 (N, 4) the actions act() received).
    """
    from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
    from sequence_ai_ros.capture.store import CaptureStore
    from sequence_ai_ros.client import connect
    from sequence_ai_ros.worker import serve_policy_file

    capture = tmp_path / 'capture'
    save_settings(capture / 'ramp', CaptureSettings(rate=1.0, enabled=True))
    received: list[np.ndarray] = []

    def observe():
        return {'state': received[-1] if received else START, 'state_names': list(NAMES)}

    def act(action):
        received.append(np.array(action.values, np.float32))
        if overruns and len(received) in overruns:
            time.sleep(overruns[len(received)] / 30)

    with serve_policy_file(RAMP, 'ramp', capture_root=capture, names=list(NAMES), step=0.001,
                           action_space=space) as server:
        with connect('ramp', endpoint=f'127.0.0.1:{server.port}') as policy:
            policy.wait_until_ready()
            out = policy.run(observe, act, max_actions=max_actions)
    assert out.reason == 'completed', out
    [episode] = CaptureStore(capture / 'ramp', 'ramp').episodes()
    return build_rows(episode, 30.0, ActionSpace(space), 4, 4, []), np.array(received)


@pytest.mark.parametrize('space', [
    'joint_absolute',
    'joint_delta',
])
def test_python_api_run_exports_what_act_received(tmp_path, space):
    """run() (the Python API): the exported rows reproduce what act() was given (joint_delta: its increments)."""
    rows, got = run_and_export(tmp_path, space, max_actions=60)
    if space == 'joint_absolute':
        np.testing.assert_array_equal(rows.action[~rows.held], got[:int((~rows.held).sum())])
    else:
        np.testing.assert_allclose(START + np.cumsum(rows.action, 0)[-1], got[-1], atol=1e-5)


def _rows_by_span_rule(sent, rate_hz, fps=30.0):
    """Rows as rows.py's module docstring defines them, from what each tick recorded (its deadline).

    A tick serving deadline g covers [g, g + 1) periods, i.e. chunk steps [g * s, (g + 1) * s) with
    s = fps / rate_hz; row k (from the first fresh tick's start) takes the tick in effect at it: its command
    when fresh, else (a hold, or deadlines no tick served) the last fresh tick's command before it; it is held
    when no fresh tick's span overlaps the row's. Returns (actions, held).
    """
    s = fps / rate_hz
    ticks = [(g, f, v) for _, f, v, g in sent]
    first = next(i for i, (_, f, _) in enumerate(ticks) if f)
    u0 = ticks[first][0] * s
    last_fresh = max(i for i, (_, f, _) in enumerate(ticks) if f)
    end = (ticks[last_fresh][0] + 1) * s
    actions, held, prev, j = [], [], None, first
    k = 0
    while u0 + k < end - 1e-6:
        p = u0 + k
        while j + 1 < len(ticks) and ticks[j + 1][0] * s <= p + 1e-6:
            if ticks[j][1]:        # a fresh tick passed over inside the previous row: the controller holds it
                prev = ticks[j][2]
            j += 1
        g, f, v = ticks[j]
        own = f and p < (g + 1) * s - 1e-6
        if f:
            prev = v
        actions.append(v if own else prev)
        # held: no fresh tick's span [g s, (g + 1) s) overlaps the row's [p, p + 1)
        fresh_in_row = any(ff and gg * s < p + 1 - 1e-6 and (gg + 1) * s > p + 1e-6 for gg, ff, _ in ticks)
        held.append(not fresh_in_row)
        k += 1
    return np.array(actions, np.float32), np.array(held)


@pytest.mark.parametrize('rate_hz', [
    15.0, 30.0, 47.0, 50.0, 100.0,
    35.0,   # ticks a little faster than the rows
])
def test_node_rows_after_a_stall_are_the_ticks_in_effect_on_their_deadlines(tmp_path, rate_hz):
    """Two stalls skip deadlines; every row is the command of the tick in effect at its step (by deadline)."""
    stalls = {40: 0.25, 80: 0.1}
    rows, result, tick, sent, _ = _run_node_episode(tmp_path, rate_hz=rate_hz, seconds=4.0, stalls=stalls, step=0.01)
    want, want_held = _rows_by_span_rule(sent, rate_hz)
    fresh_g = [g for _, f, _, g in sent if f]
    assert len(rows) == len(want), (len(rows), len(want), f'{len(fresh_g)} fresh ticks on deadlines {fresh_g[:3]}'
                                    f'..{fresh_g[-3:]}, {tick.skipped} skipped, held got '
                                    f'{np.flatnonzero(rows.held).tolist()} want {np.flatnonzero(want_held).tolist()}')
    diff = np.flatnonzero(np.any(rows.action != want, axis=1) | (rows.held != want_held))
    s = 30.0 / rate_hz
    near = [(g, f, None if v is None else round(float(v[0]), 4)) for _, f, v, g in sent
            if diff.size and abs(g * s - diff[0] - (fresh_g[0] * s)) < 4]
    assert diff.size == 0, (f'{rate_hz} Hz: rows {diff.tolist()[:12]} differ from the span rule (held got '
                            f'{np.flatnonzero(rows.held).tolist()} want {np.flatnonzero(want_held).tolist()}); '
                            f'got {rows.action[diff[:4], 0].tolist()} want {want[diff[:4], 0].tolist()}; '
                            f'ticks (deadline, fresh, j0) near the first: {near}')
    assert rows.held.any(), 'the stalls skipped deadlines: their rows are held'


def test_velocity_rows_integrate_to_the_commanded_displacement_with_late_wakeups(tmp_path):
    rng = np.random.default_rng(3)
    late = {i: float(x) for i, x in enumerate(rng.uniform(0, 0.9, 400)) if i % 2 == 0}
    rows, result, tick, sent, _ = _run_node_episode(tmp_path, rate_hz=30.0, seconds=3.0, space='joint_velocity',
                                                 step=0.2, late=late)
    # what the controller applied: each published velocity until the next published command
    fresh_idx = [i for i, (_, f, _, _) in enumerate(sent) if f]
    last = fresh_idx[-1]
    disp = np.zeros(4)
    for i in fresh_idx[:-1]:
        disp += sent[i][2] * (sent[i + 1][0] - sent[i][0])
    disp += sent[last][2] / 30.0          # rows.py gives the last tick one row period
    exported = rows.action.astype(np.float64).sum(0) / 30.0
    # joint_velocity's last channel is a gripper position (DROID), not a rate: its rows are targets
    np.testing.assert_allclose(exported[:3], disp[:3], atol=1e-4)
    assert rows.action[-1, 3] == np.float32(sent[last][2][3])


def test_run_loop_after_a_reanchor_then_a_slightly_late_tick_loses_no_step(tmp_path: Path) -> None:
    """A 5 Hz fixed-step loop (run(): Pacer(keep_phase=False)) keeps every executed step.

    Tick 3 overran >1 period, so the pacer re-anchored at 0.68 s (phase 0.4 of a row); tick 6 is 0.04 s
    (0.2 period) late, tick 7 on time. Ten act() calls, ten executed steps: ten executed rows.
    """
    store = make_store(tmp_path / 'late')
    times = [0.0, 0.2, 0.4, 0.68, 0.88, 1.08, 1.32, 1.48, 1.68, 1.88]
    # run() places each tick by the deadline it served (the pacer's count), whatever its wake-up time
    frames = [_frame(t, np.full(3, i), np.full(3, 10 + i), span=(i, i, i + 1)) for i, t in enumerate(times)]
    _, ep = _episode(store, 'late', _contract(dt=0.2), frames)
    rows = build_rows(ep, 5, ActionSpace.JOINT_ABSOLUTE, 3, 3, [])
    executed = rows.action[~rows.held][:, 0]
    np.testing.assert_array_equal(executed, np.arange(10, 20))


def _node_episode(tmp_path, **kw):
    return _run_node_episode(tmp_path, **kw)


@pytest.mark.ros
def test_joint_delta_clamped_rows_keep_the_policys_delta_in_action_policy(tmp_path):
    from sequence_ai_ros.node.config import SafetyConfig
    safety = SafetyConfig(lower_limits=(-5.0,) * 4, upper_limits=(5.0,) * 4, max_step=(0.0005,))
    rows, result, tick, sent, _ = _node_episode(tmp_path, rate_hz=30.0, seconds=2.0, space='joint_delta',
                                                safety=safety)
    commands = np.array([v for _, fresh, v, _ in sent if fresh])
    start = np.array([0.1, 0.2, 0.3, 0.4])
    # what held up: the rows sum to what the controller received
    np.testing.assert_allclose(start + rows.action.astype(np.float64).sum(0), commands[-1], atol=1e-5)
    assert rows.clamped[~rows.held].all()
    # README: `action.policy` the policy's output -- node_ramp's joint_delta output is 0.001 every step
    np.testing.assert_allclose(rows.policy_action[~rows.held], np.float32(0.001), atol=1e-6)


@pytest.mark.ros
def test_dry_rows_keep_the_policys_actions_in_action_policy(tmp_path):
    rows, result, tick, sent, _ = _node_episode(tmp_path, rate_hz=30.0, seconds=2.5, space='joint_absolute',
                                                step=0.01, toggle=set(range(25, 40)))
    dry = rows.held
    assert dry.sum() >= 10
    # the ramp moves 0.01 per step: the policy's actions in a dry stretch are not all one value
    assert len(np.unique(rows.policy_action[dry][:, 0])) > 1, rows.policy_action[dry][:, 0]


def _serve(root):
    from test_data_worker import FAST

    from sequence_ai_ros.worker import serve_policy_file
    return serve_policy_file(FAST, 'fast', capture_root=root)


def _obs():
    from test_data_worker import NAMES

    from sequence_ai_ros.client import Observation
    return Observation(state=np.zeros(26, np.float32), state_names=NAMES)


def test_a_captured_id_runs_again_and_is_told_it_is_not_captured(tmp_path):
    """A run under an id already captured (a reconnect, a reused id) is served; with capture on it is told."""
    from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
    from sequence_ai_ros.client import connect

    root = tmp_path / 'capture'
    save_settings(root / 'fast', CaptureSettings(rate=1.0, enabled=True))
    with _serve(root) as server:
        with connect('fast', endpoint=f'127.0.0.1:{server.port}') as p:
            assert p.run(_obs, lambda a: None, max_actions=20, episode_id='X').reason == 'completed'
        with connect('fast', endpoint=f'127.0.0.1:{server.port}') as p:
            again = p.run(_obs, lambda a: None, max_actions=20, episode_id='X')
        assert again.reason == 'completed' and 'already captured' in again.capture_error, again
        save_settings(root / 'fast', CaptureSettings(rate=1.0, enabled=False))
        with connect('fast', endpoint=f'127.0.0.1:{server.port}') as p:
            off = p.run(_obs, lambda a: None, max_actions=20, episode_id='X')
        assert off.reason == 'completed' and off.capture_error == '', off   # capture off: nothing to say


@pytest.mark.ros
def test_node_joint_delta_rows_sum_to_the_controller_across_a_clamp_and_an_underrun(tmp_path):
    from sequence_ai_ros.node.config import SafetyConfig
    safety = SafetyConfig(lower_limits=(-5.0,) * 4, upper_limits=(0.12, 5.0, 5.0, 5.0))
    rows, result, tick, sent, _ = _node_episode(tmp_path, rate_hz=30.0, seconds=3.0, space='joint_delta',
                                                safety=safety, prefetch=False)   # an underrun at every chunk end
    assert result.underruns >= 1, result
    commands = np.array([v for _, fresh, v, _ in sent if fresh])
    start = np.array([0.1, 0.2, 0.3, 0.4])
    np.testing.assert_allclose(start + rows.action.astype(np.float64).sum(0), commands[-1], atol=1e-5)


def test_python_api_joint_delta_rows_sum_to_the_robot_across_a_clamp_and_an_underrun(tmp_path):
    import time

    from test_node_support import RAMP

    from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
    from sequence_ai_ros.capture.store import CaptureStore
    from sequence_ai_ros.client import Observation, connect
    from sequence_ai_ros.worker import serve_policy_file

    names = ('j0', 'j1', 'j2', 'j3')
    period, limit = 1 / 30, np.float32(0.13)
    capture = tmp_path / 'capture'
    save_settings(capture / 'ramp', CaptureSettings(rate=1.0, enabled=True))
    robot = np.array([0.1, 0.2, 0.3, 0.4], np.float32)
    start = robot.copy()
    with serve_policy_file(RAMP, 'ramp', capture_root=capture, names=list(names), step=0.001,
                           action_space='joint_delta') as server, \
            connect('ramp', endpoint=f'127.0.0.1:{server.port}') as policy:
        policy.wait_until_ready()
        policy.begin_episode('reach', max_actions=10_000, control_period=period, prefetch=False)
        t = time.monotonic()
        holds = 0
        for _ in range(150):
            a = policy.next_action(Observation(state=robot, state_names=names, timestamp=t), now=t)
            if a is not None and a.hold:
                holds += 1                       # the robot repeats its last command
            elif a is not None:
                target = np.array(a.values, np.float32)
                if target[0] > limit:            # the robot's own safety clamp, reported as the docs say
                    target[0] = limit
                    policy.report_command(target, clamped=True)
                robot = target
            time.sleep(0.004)
            t += period
        policy.end_episode()
    assert holds >= 1
    [episode] = CaptureStore(capture / 'ramp', 'ramp').episodes()
    rows = build_rows(episode, 30.0, ActionSpace.JOINT_DELTA, 4, 4, [])
    np.testing.assert_allclose(start + rows.action.astype(np.float64).sum(0), robot, atol=1e-5)
