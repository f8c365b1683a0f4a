"""Field data: capture on the worker, labels, retention, exports, and rosbag tooling for replay.

- :mod:`.capture`: ``CaptureStore`` (one per deployment, ``$SEQ_HOME/capture/<name>``): sampling,
  labels, retention, usage, fault pauses. :mod:`.capture_episode`: one episode, staged then committed
  by one atomic rename. :mod:`.capture_index`: the SQLite (WAL) index. :mod:`.capture_settings`:
  ``settings.json`` and the sampling rule. :mod:`.records`: the episode record file (protobuf records).
- :mod:`.export_lerobot` (LeRobot v2.1: parquet via pyarrow, mp4 via PyAV in :mod:`.video`, stats in
  :mod:`.lerobot_stats`), :mod:`.export_jsonl`, :mod:`.verify_export` (re-read and schema check),
  :mod:`.lerobot_reader` (reads v2.1 datasets).
- :mod:`.to_rosbag` (LeRobot episode -> rosbag2 mcap, with rosbags) and :mod:`.player` (plays a bag into
  ROS 2 at its recorded timing; the only module here that imports rclpy).
- :mod:`.commands`: ``seq policy capture``, ``seq policy data export``, ``seq data to-rosbag``.

Threads: the store has none (the worker's threads call it under its lock); a LeRobot export decodes
JPEG frames in a named pool (``export-decode``) joined before it returns; the player's optional
``bag-player`` thread is owned and joined by :class:`~sequence_ai_ros.data.player.BagPlayer`.
pyarrow, PyAV and rosbags are imported lazily where they are needed.
"""
