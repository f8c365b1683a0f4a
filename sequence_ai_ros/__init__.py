"""sequence_ai_ros: drive a ROS 2 robot from a remote action-chunking policy over gRPC.

Architecture (one concept per subpackage)::

    robot side                                   policy side (GPU box)
    node/  (ROS 2 adapter: topics in, fixed-rate     worker/  (hosts policy.py, sessions, warming,
            commands out, services, /diagnostics)             usage, capture hook; `seq serve`)
      |                                                 |         |            |
    client/ (ROS-free chunk engine: prefetching  <-- gRPC -->  policy/      capture/ (field-data store)
             buffer, resampling, seams, pacing)  protocol/   (authoring   models/  (ridge, LeRobot runtime,
                                                 sequence_ai.v1  API)              what templates import)
    bags/ (LeRobot -> rosbag2, bag_player)       datasets/ (LeRobot v2.1 read/write, stats, video, JSONL)
    cli/ (`seq`), home.py ($SEQ_HOME layout), templates/ (`seq init`), bench/, demo/

Imports flow one way (test/layering.py checks it): protocol <- client <- node; protocol <- policy,
capture <- worker <- cli; datasets and bags never import the worker or the node.

The public client API is re-exported here (``sequence_ai_ros.connect``) and by the ``sequence_ai``
alias module, so that ``import sequence_ai; sequence_ai.connect(model=...)`` works unchanged.
Imports are lazy: ``import sequence_ai_ros`` loads neither gRPC nor rclpy.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Public client names, resolved lazily from sequence_ai_ros.client and .protocol.
_EXPORTS = {
    'connect': 'sequence_ai_ros.client',
    'Policy': 'sequence_ai_ros.client',
    'RunOutcome': 'sequence_ai_ros.client',
    'LabelResult': 'sequence_ai_ros.client',
    'Observation': 'sequence_ai_ros.protocol',
    'Action': 'sequence_ai_ros.protocol',
    'ActionSpace': 'sequence_ai_ros.protocol',
    'Contract': 'sequence_ai_ros.protocol',
    'EpisodeSettings': 'sequence_ai_ros.client.settings',
    # the typed errors a client is told to catch (sequence_ai_ros.exceptions has them all)
    'SequenceAIError': 'sequence_ai_ros.exceptions',
    'ConnectionLost': 'sequence_ai_ros.exceptions',
    'ContractViolation': 'sequence_ai_ros.exceptions',
    'ActionSpaceMismatch': 'sequence_ai_ros.exceptions',
    'EpisodeStateError': 'sequence_ai_ros.exceptions',
    'NotReady': 'sequence_ai_ros.exceptions',
    'PolicyException': 'sequence_ai_ros.exceptions',
    'Overloaded': 'sequence_ai_ros.exceptions',
    'Draining': 'sequence_ai_ros.exceptions',
    'Unauthenticated': 'sequence_ai_ros.exceptions',
    'UnknownDeployment': 'sequence_ai_ros.exceptions',
    'ProtocolVersionError': 'sequence_ai_ros.exceptions',
    'CaptureError': 'sequence_ai_ros.exceptions',
    'PermissionDenied': 'sequence_ai_ros.exceptions',
}

__all__ = sorted(_EXPORTS)
#: The package version, defined here only: setup.py reads it, package.xml repeats it (test_packaging checks),
#: the worker reports it in EpisodeStarted.worker_version, CHANGELOG.md lists each release.
__version__ = '0.1.0'


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
    return getattr(importlib.import_module(module), name)
