"""Adapters for the ecosystems users come from: their robot or policy interface over the client's chunk engine.

- :mod:`.lerobot_robot`: any LeRobot ``Robot`` (``get_observation()`` / ``send_action()``) as the
  ``observe``/``act`` pair of :meth:`sequence_ai_ros.client.Policy.run` and ``act``. Imports nothing from
  LeRobot (a robot is used by its two methods and its feature dicts), so it needs no torch.
- :mod:`.openpi_policy`: an openpi-client ``BasePolicy`` whose ``infer()`` is served by the worker, so openpi's
  runtime, agents and environments run unchanged. Needs ``openpi-client`` (its module says how to install it).

Both sit above the client and never import rclpy or the worker. Importing this package loads neither.
"""
