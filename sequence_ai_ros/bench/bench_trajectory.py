"""Trajectory mode of the policy node under camera load (``make bench``): messages/s and their timing.

The set-up of :mod:`.bench_node` with ``command.mode: trajectory`` (joint_trajectory interface): each new
chunk's remaining horizon goes out as one JointTrajectory. See :func:`.bench_node.run`.
"""

from __future__ import annotations

from typing import Any


def main() -> dict[str, Any]:
    """Run the trajectory-mode benchmark; print and return the figures."""
    from sequence_ai_ros.bench.bench_node import run

    return run('trajectory')
