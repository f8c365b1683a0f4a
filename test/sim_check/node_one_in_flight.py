"""``policy_node`` with one request in flight (the client's ``Policy.max_in_flight = 1``): the pipelining ablation.

The node has no parameter for it; this entry point sets the client's default before the node builds its
``Policy``, then runs the node exactly as ``python -m sequence_ai_ros.node.main`` does. check-sim verifies
the effect on the node's own per-episode line (``peak_in_flight 1``).
"""

import sys

import sequence_ai_ros.client.policy as client_policy
from sequence_ai_ros.node.main import main

client_policy.MAX_IN_FLIGHT = 1

if __name__ == '__main__':
    sys.exit(main())
