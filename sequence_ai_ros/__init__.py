"""sequence_ai_ros: drive a ROS 2 robot from a remote action-chunking policy over gRPC.

Architecture (one concept per subpackage)::

    robot side                                   policy side (GPU box)
    node/  (ROS 2 adapter: topics in, fixed-rate     worker/  (hosts policy.py, sessions, warming,
            commands out, services, /diagnostics)             usage; `seq serve`)
      |                                                 |
    client/ (ROS-free chunk engine: prefetching  <-- gRPC sequence_ai.v1 (protocol/) -->  policy/
             buffer, resampling, seams, pacing)                                (authoring API)
                                                     data/ (capture store, LeRobot v2.1/JSONL export,
                                                            rosbag tools)

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
    'Observation': 'sequence_ai_ros.protocol',
    'Action': 'sequence_ai_ros.protocol',
    'ActionSpace': 'sequence_ai_ros.protocol',
    'Contract': 'sequence_ai_ros.protocol',
}

__all__ = sorted(_EXPORTS)
__version__ = '0.1.0'


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
    return getattr(importlib.import_module(module), name)
