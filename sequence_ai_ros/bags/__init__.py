"""rosbag2 tooling for replay tests and demos.

- :mod:`.to_rosbag`: a LeRobot episode -> rosbag2 (mcap) with JointState and CompressedImage topics (rosbags).
- :mod:`.player`: ``bag_player``, a ROS 2 node that plays a bag at its recorded timing (the only
  module here that imports rclpy).

Imports: datasets (to read episodes) and exceptions; never the worker or the policy node.
Threads: the player's optional ``bag-player`` thread is owned and joined by
:class:`~sequence_ai_ros.bags.player.BagPlayer`. rosbags is imported lazily.
"""
