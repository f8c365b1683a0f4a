"""The policy authoring API: what a ``policy.py`` imports as ``import sequence_ai_ros.policy as seq``.

- :func:`policy` declares the class and its contract; :func:`on_episode` marks the end-of-episode hook.
- :class:`Episode` (per-episode state), :class:`Result` (actions plus ``done``), :class:`Batching` (a
  policy that takes requests of several episodes in one ``infer_batch`` call).
- Re-exported contract types: :class:`ObservationContract`, :class:`CameraSpec`, :class:`Contract`,
  :class:`ActionSpace`, and the validated request :class:`PolicyInput`.

Threads: none here. The worker constructs, warms and calls the policy only from its deployment's own
threads (loading on ``seq-load-<name>``, inference and hooks on ``seq-infer-<name>``), so a policy
object is never called concurrently.
"""

from sequence_ai_ros.policy.api import Batching, Episode, PolicySpec, Result, on_episode, policy, spec_of
from sequence_ai_ros.policy.loader import PolicyDefinition, load_policy_file
from sequence_ai_ros.protocol.contract import CameraSpec, Contract, ObservationContract
from sequence_ai_ros.protocol.messages import PolicyInput
from sequence_ai_ros.protocol.spaces import ActionSpace

__all__ = [
    'ActionSpace', 'Batching', 'CameraSpec', 'Contract', 'Episode', 'ObservationContract', 'PolicyDefinition',
    'PolicyInput', 'PolicySpec', 'Result', 'load_policy_file', 'on_episode', 'policy', 'spec_of',
]
