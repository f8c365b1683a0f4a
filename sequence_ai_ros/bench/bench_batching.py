"""``make bench`` part: batched against serialized inference on a compute-bound policy (see :mod:`.bench_fleet`)."""

from sequence_ai_ros.bench.bench_fleet import main_batching as main

__all__ = ['main']
