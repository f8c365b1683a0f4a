"""Adversarial review of bag_player (issue 15): corrupt bags and odd message types.

The review found three bugs here (a corrupt chunk ended in a traceback, a bag's type string imported
arbitrary top-level modules, recorded action types were called not installed); these tests, once xfail,
now hold the fixes. A test marked ``bug`` (xfail, strict) exposes a bug still open.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ros]


def bug(reason: str) -> pytest.MarkDecorator:
    """Mark a test that exposes an open bug: expected to fail on its assertion until the bug is fixed."""
    return pytest.mark.xfail(strict=True, raises=AssertionError, reason=f'bug: {reason}')


def test_a_corrupt_chunk_mid_bag_is_a_clear_error(wx200_bag, tmp_path):
    bag = tmp_path / 'corrupt'
    shutil.copytree(wx200_bag, bag)
    mcap = next(bag.glob('*.mcap'))
    mcap.chmod(0o644)
    with open(mcap, 'r+b') as f:              # the file's end (summary, index) stays intact: it opens
        f.seek(200_000)
        f.write(b'\xde\xad\xbe\xef' * 2000)
    proc = subprocess.run([sys.executable, '-m', 'sequence_ai_ros.bags.player', str(bag), '--rate', '100'],
                          capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert 'Traceback' not in out and proc.returncode == 2 and str(bag) in proc.stderr, (proc.returncode, out[-1500:])
    played = re.search(r'played (\d+) messages before it', proc.stderr)
    assert played and int(played.group(1)) > 0, proc.stderr    # what came before the corrupt chunk was played


def test_a_type_string_in_a_bag_imports_no_arbitrary_module(capsys):
    from sequence_ai_ros.bags.player import message_class
    from sequence_ai_ros.exceptions import ConfigError

    assert 'this' not in sys.modules
    with pytest.raises(ConfigError):
        message_class('this/msg/Foo')
    assert 'this' not in sys.modules and 'Zen of Python' not in capsys.readouterr().out


def test_a_python_package_with_a_msg_module_is_not_imported_unless_indexed(tmp_path, monkeypatch):
    """An importable package shaped like a message package, but absent from the ament index, is never imported."""
    from sequence_ai_ros.bags.player import message_class
    from sequence_ai_ros.exceptions import ConfigError

    pkg = tmp_path / 'lookalike_msgs'
    (pkg / 'msg').mkdir(parents=True)
    imported = tmp_path / 'imported'
    (pkg / '__init__.py').write_text(f'open({str(imported)!r}, "w").close()\n')
    (pkg / 'msg' / '__init__.py').write_text('class Foo:\n    pass\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match='no ROS interface package in the ament index'):
        message_class('lookalike_msgs/msg/Foo')
    assert not imported.exists() and 'lookalike_msgs' not in sys.modules


@pytest.mark.parametrize('msgtype', ['this/../msg/Foo', '../this/msg/Foo', 'this/Foo', 'this/msg/foo',
                                     'std_msgs/msgs/String', 'std_msgs/msg/'])
def test_a_malformed_type_string_is_refused_before_any_lookup(msgtype):
    from sequence_ai_ros.bags.player import message_class
    from sequence_ai_ros.exceptions import ConfigError

    with pytest.raises(ConfigError, match='no ROS 2 type string'):
        message_class(msgtype)
    assert 'this' not in sys.modules


def test_recorded_action_feedback_types_are_found():
    from sequence_ai_ros.bags.player import message_class
    from sequence_ai_ros.exceptions import ConfigError

    try:
        cls = message_class('sequence_ai_msgs/action/Act_FeedbackMessage')
    except ConfigError as exc:
        raise AssertionError(f'an installed action message type refused: {exc}') from None
    assert cls.__name__ == 'Act_FeedbackMessage'


@pytest.mark.parametrize('msgtype', ['sequence_ai_msgs/action/Act_Goal', 'sequence_ai_msgs/action/Act_Result',
                                     'sequence_ai_msgs/action/Act_Feedback',
                                     'sequence_ai_msgs/action/Act_SendGoal_Request',
                                     'sequence_ai_msgs/action/Act_GetResult_Response',
                                     'sequence_ai_msgs/srv/Label_Request', 'action_msgs/msg/GoalStatusArray'])
def test_the_types_rosidl_derives_for_actions_and_services_are_found(msgtype):
    from sequence_ai_ros.bags.player import message_class

    assert message_class(msgtype).__name__ == msgtype.rpartition('/')[2]


@pytest.mark.parametrize('msgtype, error', [
    ('sequence_ai_msgs/action/Act_Nope', 'no Act_Nope in sequence_ai_msgs.action'),
    ('sequence_ai_msgs/msg/Nope', 'the installed sequence_ai_msgs has no msg/Nope'),
    ('sequence_ai_msgs/action/Act', 'a service or action, not a message type'),
    ('sequence_ai_msgs/srv/Label', 'a service or action, not a message type'),
])
def test_unknown_or_non_message_types_of_an_installed_package_are_refused(msgtype, error):
    from sequence_ai_ros.bags.player import message_class
    from sequence_ai_ros.exceptions import ConfigError

    with pytest.raises(ConfigError, match=error):
        message_class(msgtype)


def test_an_action_feedback_topic_plays_beside_the_skipped_unknown_types(tmp_path, rclpy_context):
    """An action's feedback topic, as ros2 bag records it, plays; a type not installed here is skipped and listed.

    The feedback reaches a subscriber of rclpy's own ``Act.Impl.FeedbackMessage`` with its content.
    """
    import rclpy
    from ament_index_python.packages import get_package_share_directory
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.serialization import serialize_message
    from rosbags.rosbag2 import StoragePlugin, Writer
    from rosbags.typesys import Stores, get_typestore
    from rosbags.typesys.msg import get_types_from_msg
    from sequence_ai_msgs.action import Act

    from sequence_ai_ros.bags.player import BagPlayer

    store = get_typestore(Stores.ROS2_HUMBLE)
    store.register(get_types_from_msg('int32 x', 'nope_msgs/msg/Nope'))
    # The schema and type hash ros2 bag stores for the feedback topic (rosbags' typestore has no action types).
    share = Path(get_package_share_directory('sequence_ai_msgs'), 'action')
    rihs01 = {h['type_name']: h['hash_string'] for h in json.loads((share / 'Act.json').read_text())['type_hashes']}
    sep = '=' * 80
    msgdef = (f'unique_identifier_msgs/UUID goal_id\nsequence_ai_msgs/Act_Feedback feedback\n'
              f'{sep}\nMSG: unique_identifier_msgs/UUID\nuint8[16] uuid\n'
              f'{sep}\nMSG: sequence_ai_msgs/Act_Feedback\n{(share / "Act.action").read_text().split("---")[2]}')
    feedback = Act.Impl.FeedbackMessage()
    feedback.feedback.episode_id, feedback.feedback.chunks = 'ep-7', 3
    bag = tmp_path / 'action'
    with Writer(bag, version=8, storage_plugin=StoragePlugin.MCAP) as writer:
        fb = writer.add_connection('/act/_action/feedback', 'sequence_ai_msgs/action/Act_FeedbackMessage',
                                   msgdef=msgdef, rihs01=rihs01['sequence_ai_msgs/action/Act_FeedbackMessage'])
        nope = writer.add_connection('/nope', 'nope_msgs/msg/Nope', typestore=store)
        writer.write(fb, 1_000_000_000, serialize_message(feedback))
        writer.write(nope, 1_000_000_000, store.serialize_cdr(store.types['nope_msgs/msg/Nope'](x=1),
                                                              'nope_msgs/msg/Nope'))
    node = rclpy.create_node('feedback_probe', context=rclpy_context)
    got: list = []
    node.create_subscription(Act.Impl.FeedbackMessage, '/act/_action/feedback', got.append, 10)
    executor = SingleThreadedExecutor(context=rclpy_context)
    executor.add_node(node)
    player = BagPlayer(bag, context=rclpy_context)
    try:
        assert player.skipped == {'/nope': 'nope_msgs/msg/Nope'} and player.topics == ['/act/_action/feedback']
        assert player.wait_for_subscribers(20)
        player.start()
        deadline = time.monotonic() + 20
        while not got and time.monotonic() < deadline:
            executor.spin_once(timeout_sec=0.05)
        assert player.join(5) and player.error is None and player.counts == {'/act/_action/feedback': 1}
    finally:
        player.stop()
        executor.shutdown()
        node.destroy_node()
    assert [(m.feedback.episode_id, m.feedback.chunks) for m in got] == [('ep-7', 3)]
