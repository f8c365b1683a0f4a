"""Test harness: real rclpy over real DDS, real gRPC on loopback, real files. No mocks.

ROS traffic stays on this host and apart from other test sessions: discovery is limited to localhost
(ROS_AUTOMATIC_DISCOVERY_RANGE on Jazzy+, ROS_LOCALHOST_ONLY on Humble) and every pytest process
takes its own ROS_DOMAIN_ID (:func:`domain_id`: with pytest-xdist, each worker its own, never another
worker's). These are set before anything imports rclpy, and child processes inherit them.

Markers: ``ros`` (starts rclpy or DDS: a context, a node, a node process; a test asking for ``rclpy_context``
gets it without saying so) and ``slow`` (takes more than a few seconds); ``make test-fast`` runs
``-m "not ros and not slow"``. A test without ``ros`` runs with
``RMW_IMPLEMENTATION`` naming no middleware, so one that starts rclpy, in-process or in a child, fails
saying it lacks the marker. Tests that share something outside their tmp_path (a fixed file, a port
they cannot take at 0) carry ``pytest.mark.xdist_group`` so that one worker runs them in turn.
"""

from __future__ import annotations

import logging
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings

# ROS's launch package, imported by the pytest plugins of launch_testing, launch_pytest and launch_testing_ros
# wherever they are installed (a sourced distro, the dev venv), sets logging's logger class to one whose loggers
# do not propagate: every logger made afterwards (this package's) would bypass pytest's caplog and log capture.
# The tests' own processes get the standard class back; launch's own loggers keep theirs.
if logging.getLoggerClass() is not logging.Logger:
    logging.setLoggerClass(logging.Logger)

os.environ.setdefault('ROS_AUTOMATIC_DISCOVERY_RANGE', 'LOCALHOST')
os.environ.setdefault('ROS_LOCALHOST_ONLY', '1')
#: The ROS domains a test session draws from (DDS ports below Linux's ephemeral range).
DOMAINS = range(1, 101)


def domain_id() -> int:
    """Return this pytest process's ROS_DOMAIN_ID: ``SEQ_TEST_DOMAIN_ID``, else one drawn for the session.

    A plain session draws from its pid. Under pytest-xdist every worker of one run shares
    PYTEST_XDIST_TESTRUNUID, which draws the run's first domain; worker ``gwN`` takes the N-th after it,
    so two workers of one run never share a domain (up to len(DOMAINS) workers).
    """
    if os.environ.get('SEQ_TEST_DOMAIN_ID'):
        return int(os.environ['SEQ_TEST_DOMAIN_ID'])
    worker = re.fullmatch(r'gw(\d+)', os.environ.get('PYTEST_XDIST_WORKER', ''))
    if worker is None:
        return random.Random(os.getpid()).choice(DOMAINS)
    first = random.Random(os.environ.get('PYTEST_XDIST_TESTRUNUID', '')).randrange(len(DOMAINS))
    return DOMAINS[(first + int(worker.group(1))) % len(DOMAINS)]


os.environ['ROS_DOMAIN_ID'] = str(domain_id())
os.environ.setdefault('RCUTILS_LOGGING_BUFFERED_STREAM', '1')

REPO = Path(__file__).resolve().parent.parent
#: The real robot data: ../shared/data beside the repository, or $SEQ_DATA_DIR (the folder holding
#: g1_pick_bottle_v21/ and wx200_joint_states/). Tests that need it skip, saying where they looked.
SHARED_DATA = Path(os.environ.get('SEQ_DATA_DIR') or REPO.parent / 'shared' / 'data').resolve()
G1_DATASET = SHARED_DATA / 'g1_pick_bottle_v21'
WX200_BAG = SHARED_DATA / 'wx200_joint_states' / 'rosbag2'


# Hypothesis profiles for the property tests (test_engine_properties.py): ``fast`` in make test (derandomized, so a
# run is repeatable and never flaky on a loaded machine; no example database), ``long`` in make test-properties.
hypothesis_settings.register_profile('fast', max_examples=40, deadline=None, derandomize=True, database=None,
                                     suppress_health_check=[HealthCheck.too_slow])
hypothesis_settings.register_profile('long', max_examples=1500, deadline=None, database=None,
                                     suppress_health_check=[HealthCheck.too_slow])
hypothesis_settings.load_profile(os.environ.get('HYPOTHESIS_PROFILE', 'fast'))

#: RMW_IMPLEMENTATION for a test without the ``ros`` marker: rclpy.init fails on it, naming it.
NO_RMW = 'rmw_none__mark_this_test_pytest_mark_ros'


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line('markers', 'ros: starts rclpy or DDS (a context, a node, a node process)')
    config.addinivalue_line('markers', 'slow: takes more than a few seconds')


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that asks for ``rclpy_context`` starts rclpy: it is marked ``ros`` before ``-m`` selects."""
    for item in items:
        if 'rclpy_context' in getattr(item, 'fixturenames', ()):
            item.add_marker(pytest.mark.ros)


@pytest.fixture(autouse=True)
def _no_ros_without_the_marker(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """A test without ``@pytest.mark.ros`` that starts rclpy fails, in its process or in a child.

    A child process that loads rcl under NO_RMW exits 102, rcl's own check naming NO_RMW (so the node's log
    says what is missing); in this process, rclpy's Context.init is refused for the test's length. rclpy is
    loaded here first, under the real RMW_IMPLEMENTATION: rcl checks the variable when it is loaded, and
    would end this whole process.
    """
    if request.node.get_closest_marker('ros') is not None:
        return
    try:
        from rclpy.context import Context
    except ImportError:        # no ROS in this environment: nothing can start it
        return
    monkeypatch.setenv('RMW_IMPLEMENTATION', NO_RMW)

    def refuse(*_args, **_kwargs):
        raise RuntimeError(f'{request.node.nodeid} starts rclpy without @pytest.mark.ros')
    monkeypatch.setattr(Context, 'init', refuse)


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


def serving(policy: Path, deployment: str):
    """A fixture body: yield ``start(**kw)``, which serves ``policy`` as ``deployment`` on 127.0.0.1 port 0.

    ``start`` returns the endpoint; every worker started is stopped when the generator resumes (teardown).
    """
    from sequence_ai_ros.worker import serve_policy_file

    servers = []

    def start(**kwargs):
        server = serve_policy_file(policy, deployment=deployment, host='127.0.0.1', port=0, **kwargs)
        servers.append(server)
        return f'127.0.0.1:{server.port}'

    yield start
    for server in servers:
        server.stop(grace=0.5)


@pytest.fixture
def serve():
    """Start workers of test/policies/client_latency.py (deployment 'lat') on loopback.

    ``serve(**kw)`` returns the endpoint; every worker started is stopped at teardown.
    """
    yield from serving(Path(__file__).parent / 'policies' / 'client_latency.py', 'lat')
