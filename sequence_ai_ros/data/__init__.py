"""Deprecated package: field data now lives in capture/, datasets/ and bags/.

:mod:`sequence_ai_ros.capture` is the worker-side store, :mod:`sequence_ai_ros.datasets` reads and writes
LeRobot datasets (stats, video), :mod:`sequence_ai_ros.bags` converts and plays rosbags. Only
:mod:`.lerobot_reader` remains here, as a re-export for ``policy.py`` files written by earlier ``seq init``.
"""
