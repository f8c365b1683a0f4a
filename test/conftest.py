"""Test harness: real rclpy over real DDS, real gRPC on loopback, real files. No mocks.

ROS traffic stays on this host and apart from other test sessions: discovery is limited to localhost
(ROS_AUTOMATIC_DISCOVERY_RANGE on Jazzy+, ROS_LOCALHOST_ONLY on Humble) and every pytest session
takes its own ROS_DOMAIN_ID. These are set before anything imports rclpy, and child processes
inherit them.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault('ROS_AUTOMATIC_DISCOVERY_RANGE', 'LOCALHOST')
os.environ.setdefault('ROS_LOCALHOST_ONLY', '1')
os.environ['ROS_DOMAIN_ID'] = os.environ.get('SEQ_TEST_DOMAIN_ID') or str(random.Random(os.getpid()).randint(1, 100))
os.environ.setdefault('RCUTILS_LOGGING_BUFFERED_STREAM', '1')

REPO = Path(__file__).resolve().parent.parent
#: The real robot data: ../shared/data beside the repository, or $SEQ_DATA_DIR (the folder holding
#: g1_pick_bottle_v21/ and wx200_joint_states/). Tests that need it skip, saying where they looked.
SHARED_DATA = Path(os.environ.get('SEQ_DATA_DIR') or REPO.parent / 'shared' / 'data').resolve()
G1_DATASET = SHARED_DATA / 'g1_pick_bottle_v21'
WX200_BAG = SHARED_DATA / 'wx200_joint_states' / 'rosbag2'


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line('markers', 'ros: uses rclpy and DDS')
    config.addinivalue_line('markers', 'slow: takes more than a few seconds')


@pytest.fixture
def seq_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh $SEQ_HOME (registry, capture store, usage) for one test."""
    home = tmp_path / 'seq_home'
    home.mkdir()
    monkeypatch.setenv('SEQ_HOME', str(home))
    return home


@pytest.fixture
def g1_dataset() -> Path:
    """The real G1 LeRobot v2.1 dataset in ../shared/data (skips when absent)."""
    if not (G1_DATASET / 'meta' / 'info.json').exists():
        pytest.skip(f'real G1 dataset not found at {G1_DATASET} (set SEQ_DATA_DIR)')
    return G1_DATASET


@pytest.fixture
def g1(g1_dataset: Path):
    """The real G1 dataset opened with the project's LeRobot v2.1 reader."""
    from sequence_ai_ros.datasets.lerobot_reader import LeRobotDataset

    return LeRobotDataset(g1_dataset)


@pytest.fixture
def wx200_bag() -> Path:
    """The real WidowX-200 joint-state rosbag2 in ../shared/data (skips when absent)."""
    if not (WX200_BAG / 'metadata.yaml').exists():
        pytest.skip(f'real WidowX-200 bag not found at {WX200_BAG} (set SEQ_DATA_DIR)')
    return WX200_BAG


class Processes:
    """Child processes started by a test; all are terminated (then killed) at teardown."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def python(self, code: str, *args: str, **kw) -> subprocess.Popen:
        """Run ``python -c code args`` with the test's environment; stdout/stderr are pipes."""
        return self.spawn([sys.executable, '-c', code, *args], **kw)

    def spawn(self, argv: list[str], **kw) -> subprocess.Popen:
        kw.setdefault('stdout', subprocess.PIPE)
        kw.setdefault('stderr', subprocess.PIPE)
        kw.setdefault('text', True)
        kw.setdefault('env', dict(os.environ))
        proc = subprocess.Popen(argv, **kw)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


@pytest.fixture
def processes():
    """Start real processes (ROS nodes, workers); they are stopped when the test ends."""
    procs = Processes()
    yield procs
    procs.close()


@pytest.fixture
def rclpy_context():
    """An rclpy Context of the test's own, shut down in order at teardown (as rclpy's tests do)."""
    import rclpy

    context = rclpy.context.Context()
    rclpy.init(context=context)
    yield context
    if context.ok():
        rclpy.shutdown(context=context)


@pytest.fixture
def serve():
    """Start workers of test/policies/client_latency.py (deployment 'lat') on loopback.

    ``serve(**kw)`` returns the endpoint; every worker started is stopped at teardown.
    """
    from sequence_ai_ros.worker import serve_policy_file

    policy = Path(__file__).parent / 'policies' / 'client_latency.py'
    servers = []

    def start(**kwargs):
        server = serve_policy_file(policy, deployment='lat', host='127.0.0.1', port=0, **kwargs)
        servers.append(server)
        return f'127.0.0.1:{server.port}'

    yield start
    for server in servers:
        server.stop(grace=0.5)
