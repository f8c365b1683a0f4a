"""Benchmarks (``make bench``): speed and memory targets live here, never in timed unit tests.

Each ``bench_*.py`` module has a ``main() -> dict`` that runs bounded in time on loopback, prints a table
and returns its figures; ``python -m sequence_ai_ros.bench [NAME ...]`` runs them in turn and writes
``out/bench.json`` with the machine's core count.
"""
