"""The node's parts on real messages.

Image conversion, joint mapping, observation ages, safety, command messages, configuration and ROS
parameters (a real rclpy node, no executor needed).
"""

from __future__ import annotations

import io
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image as PILImage
from sensor_msgs.msg import CompressedImage, Image, JointState

from sequence_ai_ros.exceptions import ActionSpaceMismatch, ConfigError, ContractViolation
from sequence_ai_ros.node.config import CommandConfig, JointsConfig, NodeConfig, SafetyConfig
from sequence_ai_ros.node.controller_commands import CommandInterface
from sequence_ai_ros.node.images import ImageConverter, compressed_format, image_to_array
from sequence_ai_ros.node.observation import JointMapper, ObservationAssembler
from sequence_ai_ros.node.safety import SafetyFilter
from sequence_ai_ros.node.tick import TickThread
from sequence_ai_ros.protocol.contract import CameraSpec, Contract, ObservationContract

RGB = np.arange(4 * 5 * 3, dtype=np.uint8).reshape(4, 5, 3)


def _image(arr: np.ndarray, encoding: str, pad: int = 0) -> Image:
    h, w = arr.shape[:2]
    c = 1 if arr.ndim == 2 else arr.shape[2]
    rows = arr.reshape(h, w * c)
    data = np.hstack([rows, np.full((h, pad), 255, np.uint8)]) if pad else rows
    return Image(height=h, width=w, encoding=encoding, step=w * c + pad, data=data.tobytes())


def _encoded(arr: np.ndarray, fmt: str) -> bytes:
    buf = io.BytesIO()
    PILImage.fromarray(arr).save(buf, format=fmt)
    return buf.getvalue()


@pytest.mark.parametrize('encoding,make', [
    ('rgb8', lambda a: a),
    ('bgr8', lambda a: a[:, :, ::-1]),
    ('rgba8', lambda a: np.dstack([a, np.full(a.shape[:2], 9, np.uint8)])),
    ('bgra8', lambda a: np.dstack([a[:, :, ::-1], np.full(a.shape[:2], 9, np.uint8)])),
])
@pytest.mark.parametrize('pad', [0, 3])
def test_raw_encodings_become_rgb(encoding, make, pad):
    out = image_to_array(_image(np.ascontiguousarray(make(RGB)), encoding, pad))
    assert out.dtype == np.uint8 and out.shape == (4, 5, 3)
    assert np.array_equal(out, RGB)


def test_mono8_and_bad_images():
    mono = RGB[:, :, 0].copy()
    assert np.array_equal(image_to_array(_image(mono, 'mono8')), mono)
    with pytest.raises(ContractViolation, match='16UC1'):
        image_to_array(Image(height=2, width=2, encoding='16UC1', step=4, data=bytes(8)))
    with pytest.raises(ContractViolation, match='bytes'):
        image_to_array(Image(height=4, width=5, encoding='rgb8', step=15, data=bytes(10)))


def test_jpeg_passes_through_when_the_contract_size_matches_else_decodes():
    arr = np.full((48, 64, 3), 120, np.uint8)
    jpeg = _encoded(arr, 'JPEG')
    msg = CompressedImage(format='rgb8; jpeg compressed bgr8', data=jpeg)
    conv = ImageConverter(CameraSpec('cam', 64, 48, 'jpeg'))
    out = conv.from_compressed(msg)
    assert out == jpeg and conv.passthrough == 1 and conv.decoded == 0          # the very same bytes
    conv.spec = CameraSpec('cam', 32, 24, 'jpeg')
    out = conv.from_compressed(msg)
    assert isinstance(out, np.ndarray) and out.shape == (24, 32, 3) and conv.decoded == 1
    png = ImageConverter(CameraSpec('cam', 0, 0, 'jpeg')).from_compressed(
        CompressedImage(format='png', data=_encoded(arr, 'PNG')))
    assert np.array_equal(png, arr)
    assert compressed_format('jpeg') == 'jpeg' and compressed_format('png') == 'png'
    with pytest.raises(ContractViolation, match='only jpeg and png'):
        compressed_format('theora')
    with pytest.raises(ContractViolation, match='cannot be decoded'):
        ImageConverter(CameraSpec('cam', 0, 0, 'png')).from_compressed(CompressedImage(format='png', data=b'xx'))
    raw = ImageConverter(CameraSpec('cam', 10, 8, 'jpeg')).from_image(_image(RGB, 'rgb8'))
    assert raw.shape == (8, 10, 3)


def test_joints_are_mapped_by_name_never_by_position():
    mapper = JointMapper(['c', 'a'])
    msg = JointState(name=['a', 'b', 'c'], position=[1.0, 2.0, 3.0])
    assert mapper.map(msg).tolist() == [3.0, 1.0]
    with pytest.raises(ContractViolation, match=r"lacks joints \['c'\]"):
        mapper.map(JointState(name=['a', 'b'], position=[1.0, 2.0]))
    with pytest.raises(ContractViolation, match='empty name field'):
        mapper.map(JointState(name=[], position=[1.0, 2.0, 3.0]))
    with pytest.raises(ContractViolation, match='3 names but 2 positions'):
        mapper.map(JointState(name=['a', 'b', 'c'], position=[1.0, 2.0]))
    with pytest.raises(ContractViolation, match='non-finite'):
        mapper.map(JointState(name=['a', 'b', 'c'], position=[1.0, 2.0, math.nan]))


def test_a_joint_named_twice_is_refused_never_mapped_last_wins():
    mapper = JointMapper(['j0', 'j1'])
    dup = JointState(name=['j0', 'j0', 'j1'], position=[9.0, 0.1, 0.2])
    with pytest.raises(ContractViolation, match=r"names joints \['j0'\] more than once"):
        mapper.map(dup)
    with pytest.raises(ContractViolation, match=r"\['x'\] more than once"):   # even a joint not observed
        mapper.map(JointState(name=['j0', 'x', 'j1', 'x'], position=[0.0, 1.0, 2.0, 3.0]))
    assert mapper.map(JointState(name=['j1', 'j0'], position=[0.2, 0.1])).tolist() == pytest.approx([0.1, 0.2])
    with pytest.raises(ContractViolation, match='more than once'):      # the cached mapping is not reused
        mapper.map(JointState(name=['j1', 'j0', 'j0'], position=[0.2, 0.1, 9.0]))
    asm = ObservationAssembler(['j0', 'j1'], 0.5, {}, joints_source='/joint_states')
    asm.put_joints(dup, received=1.0)
    snap = asm.snapshot(1.01)
    assert snap.observation is None and snap.state is None
    assert snap.problems and snap.problems[0].startswith("/joint_states: joint_states names joints ['j0']")


def test_header_stamps_ahead_of_a_clock_that_jumped_back_are_not_fresh():
    """stamp_source='header': a stamp further ahead of the clock than max_age (sim time reset) is no sign of life."""
    clock = {'t': 5000.0}
    asm = ObservationAssembler(['a'], 0.5, {}, joints_source='/joint_states', clock=lambda: clock['t'],
                               stamp_source='header')
    asm.put_joints(JointState(name=['a'], position=[0.5]), received=10.0, stamp=4999.9)
    assert asm.snapshot(10.1).observation is not None
    clock['t'] = 5000.0 - 0.3                       # a small skew ahead (another machine's clock) is tolerated
    assert asm.snapshot(10.1).observation is not None
    clock['t'] = 4970.0                             # /clock jumped back 30 s and the source went quiet
    snap = asm.snapshot(10.2)
    assert snap.observation is None
    assert snap.problems == ['/joint_states: stamp 29.900 s ahead of the clock (> max_age 0.5 s; did the clock '
                             'jump back?)']
    asm.put_joints(JointState(name=['a'], position=[0.5]), received=10.3, stamp=4970.0)   # the source resumes
    assert asm.snapshot(10.3).observation is not None


def test_observation_ages_name_each_stale_or_missing_source():
    asm = ObservationAssembler(['a'], 0.5, {'cam': 0.2}, joints_source='/joint_states',
                               camera_sources={'cam': '/cam/image'})
    snap = asm.snapshot(10.0)
    assert snap.observation is None and any('/joint_states: no message' in p for p in snap.problems)
    asm.put_joints(JointState(name=['a'], position=[0.5]), received=10.0)
    asm.put_image('cam', lambda: RGB, received=10.0)
    snap = asm.snapshot(10.1, instruction='pick')
    assert snap.observation is not None and snap.observation.instruction == 'pick'
    assert snap.observation.state.tolist() == [0.5] and snap.observation.images['cam'] is RGB
    snap = asm.snapshot(10.3)
    assert snap.observation is None and snap.problems == ['/cam/image (cam): stale (0.300 s > max_age 0.2 s)']
    assert snap.state.tolist() == [0.5] and snap.ages['/joint_states'] == pytest.approx(0.3)
    asm.required_cameras = ()                       # a camera the contract does not need never blocks
    assert asm.snapshot(10.3).observation is not None
    asm.put_joints(JointState(name=['b'], position=[0.5]), received=10.3)   # another publisher's joint
    assert asm.snapshot(10.31).observation is not None
    assert asm.snapshot(10.6).problems == ['/joint_states: stale (0.600 s > max_age 0.5 s)']


def test_joint_states_from_several_publishers_are_merged_by_name_each_joint_with_its_age():
    """An arm's and a gripper's joint_state_broadcaster on one topic: each joint from the latest message naming it."""
    asm = ObservationAssembler(['a0', 'a1', 'grip'], 0.1, {}, joints_source='/joint_states')
    asm.put_joints(JointState(name=['a1', 'a0', 'x'], position=[0.2, 0.1, 7.0]), received=1.00)
    snap = asm.snapshot(1.01)
    assert snap.observation is None and snap.state is None
    assert snap.problems == ["/joint_states: no message has named joints ['grip'] yet"]
    asm.put_joints(JointState(name=['grip'], position=[0.04]), received=1.02)
    snap = asm.snapshot(1.03)
    assert snap.observation.state.tolist() == pytest.approx([0.1, 0.2, 0.04])
    assert snap.ages['/joint_states'] == pytest.approx(0.03)          # the oldest joint's age
    for k in range(1, 6):                                             # the arm at 100 Hz, the gripper stopped
        asm.put_joints(JointState(name=['a0', 'a1'], position=[0.1 + k, 0.2]), received=1.02 + 0.01 * k)
    assert asm.snapshot(1.08).observation.state.tolist() == pytest.approx([5.1, 0.2, 0.04])
    snap = asm.snapshot(1.15)
    assert snap.observation is None and snap.state.tolist() == pytest.approx([5.1, 0.2, 0.04])
    assert snap.problems == ["/joint_states: stale (0.130 s > max_age 0.1 s) (joints ['grip'])"]
    # one bad message costs only the joints it names, and only until they are named again
    asm.put_joints(JointState(name=['grip'], position=[math.nan]), received=1.16)
    asm.put_joints(JointState(name=['a0', 'a1'], position=[1.0, 2.0]), received=1.16)
    snap = asm.snapshot(1.17)
    assert snap.state is None and snap.problems == ["/joint_states: joint_states has non-finite positions for ['grip']"]
    asm.put_joints(JointState(name=['grip'], position=[0.05]), received=1.18)
    assert asm.snapshot(1.19).observation.state.tolist() == pytest.approx([1.0, 2.0, 0.05])
    # a configured joint named twice is refused until named again; the other joints stay good
    asm.put_joints(JointState(name=['a0', 'a0'], position=[1.0, 2.0]), received=1.20)
    snap = asm.snapshot(1.205)
    assert snap.observation is None and len(snap.problems) == 1 and "['a0'] more than once" in snap.problems[0]
    asm.put_joints(JointState(name=['a0', 'a1'], position=[1.0, 2.0]), received=1.21)
    asm.put_joints(JointState(name=['grip'], position=[0.05]), received=1.22)
    assert asm.snapshot(1.23).observation is not None
    # another publisher's malformed messages (no names, its own joint twice) change nothing ...
    asm.put_joints(JointState(name=[], position=[9.0]), received=1.225)
    asm.put_joints(JointState(name=['wheel', 'wheel'], position=[9.0, 9.0]), received=1.226)
    assert asm.snapshot(1.23).observation.state.tolist() == pytest.approx([1.0, 2.0, 0.05])
    # ... and are named when the joints go stale (a nameless publisher of ours would look just like this)
    assert asm.snapshot(1.40).problems == ['/joint_states: stale (0.190 s > max_age 0.1 s)',
                                           "/joint_states: refused a message since: joint_states names joints "
                                           "['wheel'] more than once (names ['wheel', 'wheel']); a duplicated "
                                           'name has no unambiguous position']
    asm.put_joints(JointState(name=['a0', 'a1'], position=[1.0]), received=1.24)      # 2 names, 1 position
    assert asm.snapshot(1.25).problems[0] == '/joint_states: joint_states has 2 names but 1 positions'


def test_safety_clamps_and_counts_or_stops():
    cfg = SafetyConfig(lower_limits=(-1.0, -1.0), upper_limits=(1.0, 0.5), max_step=(0.1,))
    f = SafetyFilter(cfg, ['a', 'b'])
    out = f.check(np.array([2.0, 0.3]), last=np.array([0.95, 0.3]))
    assert out.values.tolist() == [1.0, 0.3] and out.clamped == 1
    out = f.check(np.array([0.0, 0.3]), last=np.array([0.95, 0.3]))
    assert out.values.tolist() == pytest.approx([0.85, 0.3]) and out.clamped == 1
    assert f.clamps == 2 and f.counts() == {'a': {'limit': 1, 'step': 1}}
    assert 'non-finite' in f.check(np.array([math.nan, 0.0]), last=None).stop
    stop = SafetyFilter(SafetyConfig(upper_limits=(1.0, 1.0), lower_limits=(-1.0, -1.0), on_violation='stop'),
                        ['a', 'b'])
    out = stop.check(np.array([0.0, 1.5]), last=None)
    assert out.values is None and "['b']" in out.stop and stop.clamps == 0
    rates = SafetyFilter(cfg, ['a', 'b'], positions=False)
    assert rates.check(np.array([5.0, 5.0]), last=None).values.tolist() == [5.0, 5.0]


@pytest.mark.parametrize('field, values', [
    ('lower_limits', (math.nan, -1.0)), ('upper_limits', (1.0, math.inf)), ('lower_limits', (-math.inf, -1.0)),
    ('max_step', (math.nan,)), ('max_step', (math.inf,)), ('max_step', (0.1, math.nan))])
def test_safety_config_refuses_non_finite_limits(field, values):
    kwargs = {'lower_limits': (-1.0, -1.0), 'upper_limits': (1.0, 1.0), field: values}
    with pytest.raises(ConfigError, match=f'parameter safety.{field}: non-finite'):
        SafetyConfig(**kwargs)


def test_safety_config_refuses_mismatched_or_crossed_limits():
    with pytest.raises(ConfigError, match='safety.lower_limits: 2 values but safety.upper_limits has 4'):
        SafetyConfig(lower_limits=(-1.0, -1.0), upper_limits=(1.0,) * 4)
    with pytest.raises(ConfigError, match=r'safety.lower_limits: lower limit above upper limit for joints \[1\]'):
        SafetyConfig(lower_limits=(-1.0, 2.0), upper_limits=(1.0, 1.0))
    with pytest.raises(ConfigError, match='safety.upper_limits: 3 values for 2 commanded joints'):
        NodeConfig(joints=JointsConfig(names=('a', 'b')), safety=SafetyConfig(upper_limits=(1.0,) * 3))
    with pytest.raises(ConfigError, match='safety.max_step: every value must be > 0'):
        SafetyConfig(max_step=(0.0,))


def test_safety_filter_never_returns_a_non_finite_command():
    cfg = SafetyConfig(lower_limits=(-1.0, -1.0), upper_limits=(1.0, 1.0), max_step=(0.1,))
    f = SafetyFilter(cfg, ['a', 'b'])
    out = f.check(np.array([0.5, 0.5]), last=np.array([0.45, math.nan]))  # a NaN reference for the step limit
    assert out.values is None and "reference for the step limit for ['b']" in out.stop
    f.lower = np.array([math.nan, -1.0])      # a bound that got past the config (np.clip would give NaN)
    out = f.check(np.array([-2.0, 0.0]), last=None)
    assert out.values is None and "['a']" in out.stop
    assert f.clamps == 0, 'a refused command is not counted as clamped'
    f.lower = np.array([-1.0, -1.0])
    out = f.check(np.array([-2.0, 0.0]), last=None)
    assert out.values.tolist() == [-1.0, 0.0] and out.clamped == 1


def _contract(space: str, names=('a', 'b')) -> Contract:
    return Contract(action_space=space, action_names=names, dt=0.1, chunk_length=2,
                    observation=ObservationContract(state_names=('a', 'b')))


def test_command_interfaces_agree_with_action_spaces():
    fwd = CommandInterface(CommandConfig(controller='arm'), ('b', 'a'), 0.02)
    fwd.bind(_contract('joint_absolute'))
    assert fwd.topic == 'arm/commands' and fwd.order(np.array([1.0, 2.0])).tolist() == [2.0, 1.0]
    fwd.bind(_contract('joint_delta'))
    with pytest.raises(ActionSpaceMismatch, match='joint_velocity cannot be commanded through forward_command'):
        fwd.bind(_contract('joint_velocity'))
    with pytest.raises(ActionSpaceMismatch, match=r"missing from the policy \['b'\]"):
        fwd.bind(_contract('joint_absolute', ('a', 'c')))
    vel = CommandInterface(CommandConfig(controller='arm', kind='velocity'), ('a', 'b'), 0.02)
    vel.bind(_contract('joint_velocity'))
    assert vel.hold_values(np.array([0.3, 0.4])).tolist() == [0.0, 0.0]      # a velocity hold stops
    traj = CommandInterface(CommandConfig(interface='joint_trajectory', controller='arm'), ('a', 'b'), 0.02)
    with pytest.raises(ActionSpaceMismatch):
        traj.bind(_contract('ee_absolute', tuple('xyzabcd')))
    traj.bind(_contract('joint_absolute'))
    msg, _ = traj.build(np.array([1.0, 2.0]), JointState().header.stamp)
    assert traj.topic == 'arm/joint_trajectory' and msg.joint_names == ['a', 'b']
    assert list(msg.points[0].positions) == [1.0, 2.0] and msg.points[0].time_from_start.nanosec == 20_000_000


def test_pose_and_twist_layouts():
    stamp = JointState().header.stamp
    pose = CommandInterface(CommandConfig(interface='pose', topic='/ee/pose', frame_id='base', gripper_topic='/g'),
                            (), 0.02)
    pose.bind(_contract('ee_absolute', tuple('xyzabcdg')))
    msg, grip = pose.build(np.array([1, 2, 3, 0, 0, 0.6, 0.8, 0.25], float), stamp)
    assert (msg.pose.position.x, msg.pose.position.z, msg.pose.orientation.z, msg.pose.orientation.w) == \
        (1.0, 3.0, 0.6, 0.8)
    assert msg.header.frame_id == 'base' and list(grip.data) == [0.25]
    twist = CommandInterface(CommandConfig(interface='twist', topic='/ee/twist'), (), 0.02)
    with pytest.raises(ActionSpaceMismatch, match='gripper_topic'):
        twist.bind(_contract('ee_delta', tuple('xyzabcg')))
    twist.bind(_contract('ee_delta', tuple('xyzabc')))
    msg, grip = twist.build(np.array([0.01, 0, 0, 0, 0, 0.05]), stamp)
    assert msg.twist.linear.x == pytest.approx(0.1) and msg.twist.angular.z == pytest.approx(0.5) and grip is None
    with pytest.raises(ActionSpaceMismatch):
        twist.bind(_contract('ee_absolute', tuple('xyzabcd')))


def test_config_errors_name_the_parameter():
    with pytest.raises(ConfigError, match='command.interface'):
        CommandConfig(interface='effort')
    with pytest.raises(ConfigError, match='command.topic'):
        CommandConfig(interface='pose')
    with pytest.raises(ConfigError, match='joints.names'):
        JointsConfig(names=('a', 'a'))
    with pytest.raises(ConfigError, match='safety.lower_limits: 1 values for 2'):
        NodeConfig(joints=JointsConfig(names=('a', 'b')), safety=SafetyConfig(lower_limits=(0.0,)))
    with pytest.raises(ConfigError, match='control_rate_hz'):
        NodeConfig(control_rate_hz=0)
    with pytest.raises(ConfigError, match='lower limit above upper'):
        SafetyConfig(lower_limits=(1.0,), upper_limits=(0.0,))


def test_parameters_are_declared_with_descriptors(rclpy_context):
    import rclpy
    from rclpy.parameter import Parameter

    from sequence_ai_ros.node.parameters import declare_and_read

    node = rclpy.create_node('params_probe', context=rclpy_context, parameter_overrides=[
        Parameter('joints.names', value=['x', 'y']), Parameter('camera_names', value=['front']),
        Parameter('cameras.front.topic', value='/front/image'), Parameter('safety.max_step', value=[0.1])])
    try:
        cfg = declare_and_read(node)
        assert cfg.joints.names == ('x', 'y') and cfg.cameras[0].key == 'front' and cfg.safety.max_step == (0.1,)
        assert cfg.command_joint_names == ('x', 'y') and cfg.control_rate_hz == 50.0
        desc = node.describe_parameter('control_rate_hz')
        assert desc.read_only and desc.floating_point_range[0].to_value == 1000.0 and desc.description
        assert not node.describe_parameter('enabled').read_only
        result = node.set_parameters([Parameter('control_rate_hz', value=10.0)])[0]
        assert not result.successful                        # read_only: a change needs a restart
    finally:
        node.destroy_node()
    bad = rclpy.create_node('params_bad', context=rclpy_context,
                            parameter_overrides=[Parameter('command.interface', value='effort')])
    try:
        with pytest.raises(ConfigError, match='command.interface'):
            declare_and_read(bad)
    finally:
        bad.destroy_node()


def test_empty_joint_names_or_model_cannot_run():
    assert NodeConfig().joints.names == ()   # a template without joints or model is a valid configuration...
    with pytest.raises(ConfigError, match='parameter joints.names: empty'):
        NodeConfig(model='m').check_runnable()       # ...but the node cannot run on it
    with pytest.raises(ConfigError, match='parameter model: empty'):
        NodeConfig(joints=JointsConfig(names=('a',))).check_runnable()
    NodeConfig(model='m', joints=JointsConfig(names=('a',))).check_runnable()


@pytest.mark.parametrize('name, value, match', [
    ('control_rate_hz', 0.0, r'must be within \[1.0, 1000.0\]'),
    ('control_rate_hz', math.nan, r'must be within \[1.0, 1000.0\]'),
    ('control_rate_hz', 1e6, r'must be within \[1.0, 1000.0\]'),
    ('control_rate_hz', 50, '.*INTEGER'),
    ('joints.max_age_s', -1.0, r'must be within \[0.001, 3600.0\]'),
    ('stale_grace_s', math.nan, r'must be within \[0.01, 3600.0\]'),
    ('qos.depth', 0, r'must be within \[1, 1000\]'),
    ('safety.upper_limits', [1.0, math.nan], 'non-finite values at indices \\[1\\]')])
def test_out_of_range_parameters_are_config_errors_naming_the_parameter(rclpy_context, name, value, match):
    import rclpy
    from rclpy.parameter import Parameter

    from sequence_ai_ros.node.parameters import declare_and_read

    node = rclpy.create_node('params_range', context=rclpy_context, parameter_overrides=[
        Parameter('joints.names', value=['a', 'b']), Parameter(name, value=value)])
    try:
        with pytest.raises(ConfigError, match=f'parameter {name}: {match}'):
            declare_and_read(node)
    finally:
        node.destroy_node()


def test_tick_thread_calls_with_monotonic_times_and_survives_errors():
    seen: list[float] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def fn(now: float) -> None:
        seen.append(now)
        if len(seen) == 3:
            raise RuntimeError('bad tick')
        if len(seen) >= 6:
            tick.stop()     # from its own thread: no further tick (a stop from here, on busy cores, could land
            done.set()      # just after the pacer took the next deadline)

    tick = TickThread(0.005, fn, on_error=errors.append, name='test-tick')
    tick.start()
    assert done.wait(5.0)
    tick.stop()
    assert not tick.alive and tick._thread.name == 'test-tick'
    assert all(b > a for a, b in zip(seen, seen[1:], strict=False)) and len(errors) == 1
    # the jitter it reports is |dt - period| of exactly the times it passed to fn
    errors = np.abs(np.diff(seen) - 0.005) * 1e3
    p50, p99, worst = tick.jitter_ms()
    assert worst == pytest.approx(errors.max(), abs=1e-9) and p50 == pytest.approx(np.percentile(errors, 50))
    assert p50 <= p99 <= worst and tick.ticks == len(seen)


def test_one_pacer_counts_the_ticks_a_stalled_control_thread_skips():
    """TickThread paces with the client's Pacer: a stall of several periods skips ticks (counted), never bunches."""
    from sequence_ai_ros.client.pacing import Pacer

    seen: list[float] = []
    done = threading.Event()

    def fn(now: float) -> None:
        seen.append(now)
        if len(seen) == 3:
            threading.Event().wait(0.1)         # an injected stall of 10 periods
        if len(seen) >= 8:
            done.set()

    tick = TickThread(0.01, fn, name='test-stall')
    tick.start()
    assert done.wait(5.0)
    tick.stop()
    assert tick.skipped >= 5, tick.skipped
    assert tick.ticks == len(seen) >= 8
    pacer = Pacer(0.01)
    threading.Event().wait(0.05)
    pacer.wait()
    assert pacer.skipped >= 2


def test_a_pacer_woken_as_its_deadline_comes_serves_no_tick():
    """A stop that lands as the control thread's next deadline comes: that deadline gets no tick, none is counted.

    TickThread checks its stop after the pacer's wait; a wait that counted the deadline there left ``ticks``
    one above the ticks run (a loaded machine wakes the thread late, past the deadline, on its stop).
    """
    from sequence_ai_ros.client.pacing import Pacer

    stop = threading.Event()
    pacer = Pacer(0.01, wake=stop, spin=False, keep_phase=True)
    pacer.first()
    threading.Event().wait(0.012)      # deadline 1 has come (on a loaded machine, maybe a period or more ago)
    stop.set()
    pacer.wait()
    assert pacer.ticks == 1 and pacer.served_k == 0, (pacer.ticks, pacer.served_k)


def test_a_control_thread_woken_late_skips_and_its_skip_count_never_falls():
    """A wake-up more than a period late (the GIL held elsewhere) skips the passed deadlines, as an overrun does.

    /diagnostics counts a deadline as skipped once it is a period old without a tick, so that deadline must
    not get a tick later. Before, the late wake-up served its old deadline, the next tick followed at once,
    and the count fell by one (an episode's feedback then claimed a skip that /diagnostics did not).
    """
    seen: list[float] = []
    tick = TickThread(0.02, seen.append, name='test-late-wake')
    interval = sys.getswitchinterval()
    counts = []
    try:
        tick.start()
        threading.Event().wait(0.1)
        sys.setswitchinterval(0.3)   # this thread keeps the GIL for up to 0.3 s: the control thread wakes late
        end = time.monotonic() + 0.2
        while time.monotonic() < end:
            counts.append(tick.skipped_now())
    finally:
        sys.setswitchinterval(interval)
    threading.Event().wait(0.1)
    counts.append(tick.skipped_now())
    tick.stop()
    assert counts[-1] >= 5, counts[-1]          # the hold lasted ~10 periods
    assert all(b >= a for a, b in zip(counts, counts[1:], strict=False)), sorted(set(counts))
    assert tick.ticks == len(seen)


def _report(**kw):
    from sequence_ai_ros.node import diagnostics

    base = dict(state='running', episode_id='ep', deployment='m', endpoint='127.0.0.1:1', action_space='joint_absolute',
                connection='ready', connection_error='', ready=True, enabled=True, stats={}, clamps=0,
                clamp_counts={}, jitter_ms=(0.1, 0.5, 1.0), rate_hz=50.0, ticks_skipped=0, sent=10, problems=[],
                ages={})
    base.update(kw)
    return diagnostics.Report(**base)


def test_dropped_telemetry_is_reported_in_status_and_diagnostics():
    from builtin_interfaces.msg import Time

    from sequence_ai_ros.node import diagnostics

    r = _report(dropped_telemetry=7)
    assert diagnostics.status_message(r, Time()).dropped_telemetry == 7
    episode = next(s for s in diagnostics.diagnostic_array(r, 'n', Time()).status if s.name == 'n: episode')
    assert {kv.key: kv.value for kv in episode.values}['dropped_telemetry'] == '7'


def test_the_node_spin_loop_survives_an_entity_destroyed_while_waited_on(rclpy_context):
    """The spin loop goes on past rclpy's InvalidHandle; any other error still propagates.

    A lifecycle cleanup can destroy a subscription while an executor builds its wait set.
    """
    from rclpy._rclpy_pybind11 import InvalidHandle
    from rclpy.executors import SingleThreadedExecutor

    from sequence_ai_ros.node.main import spin_until

    stop = threading.Event()
    calls = []

    class Racing(SingleThreadedExecutor):
        def spin_once(self, timeout_sec=None):
            calls.append(timeout_sec)
            if len(calls) == 1:
                raise InvalidHandle('cannot use Destroyable because destruction was requested')
            if len(calls) == 3:
                stop.set()
            super().spin_once(timeout_sec=0.0)

    spin_until(Racing(context=rclpy_context), stop, rclpy_context)
    assert len(calls) == 3

    class Broken(SingleThreadedExecutor):
        def spin_once(self, timeout_sec=None):
            raise RuntimeError('a real bug')

    with pytest.raises(RuntimeError, match='a real bug'):
        spin_until(Broken(context=rclpy_context), threading.Event(), rclpy_context)


def test_the_control_thread_runs_sched_fifo_at_its_priority_or_says_why_not():
    """thread_priority > 0: the thread itself (not the process) is SCHED_FIFO at that priority; 0: default."""
    if not hasattr(os, 'sched_getscheduler'):
        pytest.skip('no POSIX scheduling API on this platform')
    policies = {}

    def fn(now: float) -> None:
        policies[threading.current_thread().name] = (os.sched_getscheduler(0), os.sched_getparam(0).sched_priority)

    for name, priority in (('fifo-tick', 37), ('plain-tick', 0)):
        tick = TickThread(0.005, fn, name=name, priority=priority)
        scheduling = tick.start()
        deadline = time.monotonic() + 5
        while name not in policies and time.monotonic() < deadline:
            time.sleep(0.01)
        tick.stop()
        if priority and scheduling.startswith('default ('):
            assert 'refused' in scheduling   # no CAP_SYS_NICE here: the reason is kept, the thread still ran
            assert policies[name][0] == os.SCHED_OTHER
            continue
        assert scheduling == ('SCHED_FIFO 37' if priority else 'default'), scheduling
        assert policies[name] == ((os.SCHED_FIFO, 37) if priority else (os.SCHED_OTHER, 0))
    assert os.sched_getscheduler(0) == os.SCHED_OTHER     # the calling thread is left as it was


def test_a_refused_real_time_priority_is_reported_and_the_thread_still_ticks():
    """Without CAP_SYS_NICE and with rtprio limit 0 SCHED_FIFO is refused (EPERM): reported, not fatal."""
    import ctypes
    import resource

    libc = ctypes.CDLL(None, use_errno=True)
    if os.geteuid() != 0 or not hasattr(libc, 'prctl'):
        pytest.skip('dropping CAP_SYS_NICE needs root on Linux')

    def drop_sys_nice() -> None:   # in the child, before exec: out of the bounding set, so not in its caps
        if libc.prctl(24, 23, 0, 0, 0) != 0:   # PR_CAPBSET_DROP, CAP_SYS_NICE (linux/prctl.h, capability.h)
            raise OSError(ctypes.get_errno(), 'PR_CAPBSET_DROP')
        resource.setrlimit(resource.RLIMIT_RTPRIO, (0, 0))

    code = ('import threading\n'
            'from sequence_ai_ros.node.tick import TickThread\n'
            'done = threading.Event()\n'
            'tick = TickThread(0.005, lambda now: done.set(), priority=50)\n'
            'print(tick.start(), done.wait(5), flush=True)\n'
            'tick.stop()\n')
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=30,
                         preexec_fn=drop_sys_nice,
                         env={**os.environ, 'PYTHONPATH': str(Path(__file__).resolve().parents[1])})
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith('default (SCHED_FIFO 50 refused: ') and out.stdout.strip().endswith('True'), out.stdout


def test_the_episode_log_line_carries_the_outcome() -> None:
    """One line per episode: reason, actions, chunks, underruns, the tick counts, seam jump and gap, peak in flight.

    What a reader of the node's log needs to tell a dry seam from a slow policy.
    """
    from sequence_ai_ros.client.outcome import RunOutcome
    from sequence_ai_ros.node.runner import EpisodeReport, episode_line

    report = EpisodeReport('ep-1', 'timeout', 'max_seconds 2 s reached', actions=60, chunks=3, underruns=1,
                           underrun_s=0.25, max_seam_jump=0.05, commands_sent=90, ticks_held=12, ticks_skipped=2,
                           max_seam_gap=0.01, peak_in_flight=2)
    out = RunOutcome(actions=60, chunks=3, elapsed_s=2.0, reason='timeout', max_seam_gap=0.01, peak_in_flight=2,
                     requests=4)
    # the report carries the seams and pipelining itself: the line has them also when the worker's end failed
    parts = ('episode ep-1 ended: timeout', 'actions 60', 'chunks 3', 'underruns 1 (0.250 s)', 'commands_sent 90',
             'ticks_held 12', 'ticks_skipped 2', 'max_seam_jump 0.05', 'max_seam_gap 0.01', 'peak_in_flight 2',
             'max_seconds 2 s reached')
    for line in (episode_line(report, out), episode_line(report)):
        for part in parts:
            assert part in line, (part, line)
    assert 'requests 4' in episode_line(report, out)       # the worker's inferences (check-sim counts them)


def test_the_prefetch_margin_parameter_is_each_episodes_setting():
    from sequence_ai_ros.client.settings import EpisodeSettings

    assert NodeConfig().prefetch_margin == EpisodeSettings().prefetch_margin == 4.0
    assert NodeConfig(prefetch_margin=0.0).prefetch_margin == 0.0
    with pytest.raises(ConfigError, match='prefetch_margin'):
        NodeConfig(prefetch_margin=-1.0)


def test_the_prefetch_margin_parameter_has_the_clients_bounds():
    """One range on both sides: the node's schema bound is the client's MAX_PREFETCH_MARGIN; past a double: typed."""
    from sequence_ai_ros.client.settings import MAX_PREFETCH_MARGIN, EpisodeSettings
    from sequence_ai_ros.node.config import SCHEMA

    assert list(SCHEMA.spec('prefetch_margin').validation['bounds<>']) == [0.0, MAX_PREFETCH_MARGIN]
    assert NodeConfig(prefetch_margin=MAX_PREFETCH_MARGIN).prefetch_margin == EpisodeSettings(
        prefetch_margin=MAX_PREFETCH_MARGIN).prefetch_margin
    for value in (math.nextafter(MAX_PREFETCH_MARGIN, math.inf), math.nan, math.inf, 10 ** 400, True, '4'):
        with pytest.raises(ConfigError, match='prefetch_margin'):
            NodeConfig(prefetch_margin=value)


def test_the_aggregate_parameter_is_checked_from_its_schema_entry():
    assert NodeConfig().aggregate == ''                      # as the deployment's contract declares
    assert NodeConfig(aggregate='weighted_average').aggregate == 'weighted_average'
    with pytest.raises(ConfigError, match='aggregate'):
        NodeConfig(aggregate='conservative')
