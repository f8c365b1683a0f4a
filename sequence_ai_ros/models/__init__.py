"""Models and their training: what templates' ``policy.py`` files import.

- :mod:`.ridge`: the embedded linear chunk model (numpy only) and its features.
- :mod:`.ridge_training`: ``seq train ridge`` on a LeRobot v2.1 dataset, with a held-out evaluation.
- :mod:`.lerobot_runtime`: loads a LeRobot checkpoint through LeRobot's own processor pipeline.

Imports: protocol, policy (contracts), datasets (training data) and exceptions; never the worker,
the client or the node. Threads: none.
"""
