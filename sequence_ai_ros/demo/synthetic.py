"""A synthetic robot for the demo without a dataset: JointState of the G1's joints, slowly moving.

``python -m sequence_ai_ros.demo.synthetic --topic /joint_states --rate 100 --names a b c``
publishes positions ``0.2 * sin(2*pi*0.2*t + i)`` (rad) until SIGINT. Labelled synthetic in the summary.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import rclpy
from rclpy.executors import ExternalShutdownException
from sensor_msgs.msg import JointState


def main(argv: list[str] | None = None) -> int:
    """Publish synthetic joint_states until interrupted."""
    parser = argparse.ArgumentParser(prog='python -m sequence_ai_ros.demo.synthetic')
    parser.add_argument('--topic', default='/joint_states')
    parser.add_argument('--rate', type=float, default=100.0, help='Hz')
    parser.add_argument('--names', nargs='+', required=True)
    args = parser.parse_args(argv)
    rclpy.init()
    node = rclpy.create_node('synthetic_robot')
    pub = node.create_publisher(JointState, args.topic, 10)
    start = time.monotonic()

    def tick() -> None:
        t = time.monotonic() - start
        msg = JointState(name=list(args.names),
                         position=[0.2 * math.sin(2 * math.pi * 0.2 * t + i) for i in range(len(args.names))])
        msg.header.stamp = node.get_clock().now().to_msg()
        pub.publish(msg)

    node.create_timer(1.0 / args.rate, tick)
    print('synthetic robot publishing', flush=True)
    try:
        rclpy.spin(node)
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        node.destroy_node()
        rclpy.try_shutdown()
    return 0


if __name__ == '__main__':
    sys.exit(main())
