"""``make bench`` part: the worker's transport ceiling, 48/64/128 robots on a 0 ms policy (see :mod:`.bench_fleet`)."""

from sequence_ai_ros.bench.bench_fleet import main_transport as main

__all__ = ['main']
