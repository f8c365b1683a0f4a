"""Convert one episode of a LeRobot v2.1 dataset into a rosbag2 (mcap), for replay tests and demos.

Written with the ``rosbags`` library (pure Python, no ROS install): per frame k at ``t0 + timestamp_k``,

- ``sensor_msgs/msg/JointState`` on the joint topic: ``name`` = the dataset's ``observation.state``
  names, ``position`` = ``observation.state`` (float64; rad for revolute joints, the dataset's own unit
  otherwise), empty velocity and effort;
- ``sensor_msgs/msg/CompressedImage`` per camera: ``format`` ``"jpeg"``, the frame decoded from the
  dataset's video (PyAV) and JPEG-encoded (Pillow, quality 90).

Both at the dataset's fps (the recorded rate), header stamps equal to the bag timestamps.

Compatibility. The bag is written with rosbag2 **metadata version 8** in **mcap** storage. Version 8 keeps
``offered_qos_profiles`` as a YAML string with numeric QoS values, the form every distro since Foxy
parses; version 9 (Kilted/Rolling) switched it to a YAML list with names, which rosbag2 on Humble and
Jazzy cannot read. Newer distros read older metadata versions, and older ones ignore the keys they do not
know (``type_description_hash``, ``ros_distro``, ``custom_data``). So ``ros2 bag play`` should accept it on
Humble (with the mcap storage plugin installed: ``ros-humble-rosbag2-storage-mcap``; mcap is not Humble's
default storage), Iron, Jazzy (mcap is the default there) and Kilted. This could not be checked on this
machine, which has no rosbag2; it was checked with ``rosbags``' reader and this package's player.
"""

from __future__ import annotations

import io
import time
from pathlib import Path
from typing import Any

import numpy as np

from sequence_ai_ros.datasets.lerobot_reader import LeRobotDataset
from sequence_ai_ros.exceptions import ConfigError, ExportError, MissingDependency

METADATA_VERSION = 8


def _rosbags() -> dict[str, Any]:
    try:
        from rosbags.interfaces import Qos, QosDurability, QosHistory, QosLiveliness, QosReliability, QosTime
        from rosbags.rosbag2 import StoragePlugin, Writer
        from rosbags.typesys import Stores, get_typestore
    except ImportError as exc:
        raise MissingDependency(f'writing rosbags needs the rosbags package ({exc}); '
                                f'install it with: pip install rosbags') from None
    default = QosTime(0, 0)  # RMW_DURATION_UNSPECIFIED: the rmw default (no deadline, no lifespan)
    qos = Qos(QosHistory.KEEP_LAST, 10, QosReliability.RELIABLE, QosDurability.VOLATILE, default, default,
              QosLiveliness.AUTOMATIC, default, False)
    return {'Writer': Writer, 'StoragePlugin': StoragePlugin, 'Stores': Stores, 'get_typestore': get_typestore,
            'qos': qos}


def _jpeg(rgb: np.ndarray, quality: int = 90) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format='JPEG', quality=quality)
    return buf.getvalue()


def episode_to_rosbag(dataset: str | Path, episode: int, out: str | Path, *, joint_topic: str = '/joint_states',
                      camera_topics: dict[str, str] | None = None, distro: str = 'humble',
                      start_ns: int | None = None, frame_id: str = '') -> dict[str, Any]:
    """Write episode ``episode`` of a LeRobot v2.1 dataset as a rosbag2 at ``out``.

    :param dataset: the dataset directory.
    :param episode: its episode_index.
    :param out: the bag directory to create (must not exist).
    :param joint_topic: topic of the JointState messages.
    :param camera_topics: {camera key: CompressedImage topic}; None = ``/<key>/image_raw/compressed``
        for every camera of the dataset; ``{}`` = joints only.
    :param distro: rosbags typestore of the message definitions (humble, jazzy, kilted, ...).
    :param start_ns: the bag's first timestamp (ns since the epoch); now when None.
    :param frame_id: ``header.frame_id`` of every message.
    :returns: ``{'out', 'counts': {topic: messages}, 'duration_s', 'fps', 'version'}``.
    :raises ConfigError: for an unknown dataset, episode, camera or distro.
    :raises ExportError: when ``out`` exists.
    """
    rb = _rosbags()
    ds = LeRobotDataset(dataset)
    out = Path(out)
    if out.exists():
        raise ExportError(f'{out} exists; rosbag2 writers never overwrite: remove it or choose another --out')
    try:
        store = rb['get_typestore'](rb['Stores'](f'ros2_{distro.lower()}'))
    except ValueError:
        raise ConfigError(f'unknown ROS distro {distro!r} for the message definitions') from None
    data = ds.episode(episode)
    if camera_topics is None:
        camera_topics = {key: f'/{key}/image_raw/compressed' for key in ds.camera_keys}
    for key in camera_topics:
        ds.video_shape(key)  # raises ConfigError for an unknown camera
    names = list(ds.state_names)
    t0 = time.time_ns() if start_ns is None else int(start_ns)
    stamps = [t0 + int(round(float(t) * 1e9)) for t in data.timestamp]
    joint_state_t = store.types['sensor_msgs/msg/JointState']
    compressed_image_t = store.types['sensor_msgs/msg/CompressedImage']
    header_t = store.types['std_msgs/msg/Header']
    time_t = store.types['builtin_interfaces/msg/Time']
    counts: dict[str, int] = {}

    def header(ns: int) -> Any:
        return header_t(stamp=time_t(sec=ns // 1_000_000_000, nanosec=ns % 1_000_000_000), frame_id=frame_id)

    writer = rb['Writer'](out, version=METADATA_VERSION, storage_plugin=rb['StoragePlugin'].MCAP)
    try:
        with writer:
            joints = writer.add_connection(joint_topic, joint_state_t.__msgtype__, typestore=store,
                                           offered_qos_profiles=[rb['qos']])
            cams = {key: writer.add_connection(topic, compressed_image_t.__msgtype__, typestore=store,
                                               offered_qos_profiles=[rb['qos']])
                    for key, topic in camera_topics.items()}
            videos = {key: ds.frames(episode, key) for key in cams}
            empty = np.zeros(0, np.float64)
            counts = {joint_topic: 0, **{camera_topics[key]: 0 for key in cams}}
            for k, (ns, state) in enumerate(zip(stamps, data.state, strict=True)):
                msg = joint_state_t(header=header(ns), name=names, position=state.astype(np.float64),
                                 velocity=empty, effort=empty)
                writer.write(joints, ns, store.serialize_cdr(msg, joint_state_t.__msgtype__))
                counts[joint_topic] += 1
                for key, conn in cams.items():
                    rgb = next(videos[key], None)
                    if rgb is None:
                        raise ExportError(f'episode {episode} camera {key}: the video ends at frame {k} of '
                                          f'{len(stamps)}')
                    img = compressed_image_t(header=header(ns), format='jpeg', data=np.frombuffer(_jpeg(rgb), np.uint8))
                    writer.write(conn, ns, store.serialize_cdr(img, compressed_image_t.__msgtype__))
                    counts[camera_topics[key]] += 1
    except BaseException:
        import shutil

        shutil.rmtree(out, ignore_errors=True)
        raise
    duration = (stamps[-1] - stamps[0]) / 1e9 if stamps else 0.0
    return {'out': str(out), 'counts': counts, 'duration_s': duration, 'fps': ds.fps, 'version': METADATA_VERSION}
