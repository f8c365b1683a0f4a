"""A synthetic robot for the demo without a dataset: JointState of the G1's joints, slowly moving.

``python -m sequence_ai_ros.demo.synthetic --topic /joint_states --rate 100 --names a b c [--lower ..
--upper ..]`` publishes positions ``c_i + A_i * sin(2*pi*0.1*t + i)`` until SIGINT: with limits, c_i is the
middle of joint i's range and A_i = min(0.1, a quarter of the range), so every joint stays within its limits
(the G1's hands, 0..1, swing 0.4..0.6); without, c_i = 0 and A_i = 0.1 (rad). At most 0.063 rad/s: the robot
ignores commands, so the ``hold`` template's one-second chunks step by what it moved in between (at most
~0.06 per seam, under the G1 config's max_step of 0.1). Labelled synthetic in the summary.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import rclpy
from rclpy.executors import ExternalShutdownException
from sensor_msgs.msg import JointState

AMPLITUDE = 0.1      # rad (or hand units), at most a quarter of a joint's range
FREQUENCY_HZ = 0.1


def motion(n: int, lower: list[float] | None, upper: list[float] | None,
           amplitude: float = AMPLITUDE) -> tuple[list[float] | None, list[float]]:
    """Return the centre and amplitude of each joint's swing, inside [lower, upper] when given.

    :returns: (centres, amplitudes), n each; centres None when the limits do not have n values each or a
        lower limit is above its upper limit.
    """
    if lower is None and upper is None:
        return [0.0] * n, [amplitude] * n
    if lower is None or upper is None or len(lower) != n or len(upper) != n or any(
            lo > hi for lo, hi in zip(lower, upper, strict=True)):
        return None, []
    return ([(lo + hi) / 2 for lo, hi in zip(lower, upper, strict=True)],
            [min(amplitude, (hi - lo) / 4) for lo, hi in zip(lower, upper, strict=True)])


def main(argv: list[str] | None = None) -> int:
    """Publish synthetic joint_states until interrupted."""
    parser = argparse.ArgumentParser(prog='python -m sequence_ai_ros.demo.synthetic')
    parser.add_argument('--topic', default='/joint_states')
    parser.add_argument('--rate', type=float, default=100.0, help='Hz')
    parser.add_argument('--names', nargs='+', required=True)
    parser.add_argument('--lower', nargs='+', type=float, default=None, help='lower limit per joint')
    parser.add_argument('--upper', nargs='+', type=float, default=None, help='upper limit per joint')
    args = parser.parse_args(argv)
    center, amplitude = motion(len(args.names), args.lower, args.upper)
    if center is None:
        parser.error(f'--lower and --upper need one value per joint ({len(args.names)}), lower <= upper')
    rclpy.init()
    node = rclpy.create_node('synthetic_robot')
    pub = node.create_publisher(JointState, args.topic, 10)
    start = time.monotonic()

    def tick() -> None:
        t = time.monotonic() - start
        msg = JointState(name=list(args.names),
                         position=[c + a * math.sin(2 * math.pi * FREQUENCY_HZ * t + i)
                                   for i, (c, a) in enumerate(zip(center, amplitude, strict=True))])
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
