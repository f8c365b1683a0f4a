"""A simulated robot for closed-loop tests: a Meta-World task (MuJoCo) as a ROS 2 node.

Modules, one concept each:

- :mod:`.task` (ROS-free): one Meta-World ML1 task, seeded resets to its ``train``/``test`` instances,
  position commands (``ee_x ee_y ee_z gripper``), the measured state and headless camera frames;
- :mod:`.commands` (ROS-free): forward commands and joint trajectories, sampled at each step;
- :mod:`.config`: the node's parameters, one dataclass;
- :mod:`.node` (rclpy): ``sim_robot``, its topics, ``~/reset`` and ``~/status``, and the stepping thread;
- :mod:`.main`: the ``sim_robot`` console script.

Threads: the executor (main thread) serves subscriptions, the status timer and ``~/reset``; ``sim-step``
(owned by :class:`.node.SimRobot`) alone touches MuJoCo: steps, resets, renders.

Needs the ``[sim]`` extra (metaworld, mujoco, packaging); importing this package loads none of them.
"""
