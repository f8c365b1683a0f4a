"""Build of sequence_ai_ros: ament_python for colcon, and a plain pip package without ROS.

Three install paths, one rule: the gRPC stubs (``protocol/sequence_ai_pb2*.py`` and their type stubs
``*.pyi``, never committed) are generated here, at build time, by ``grpc_tools.protoc``:

- colcon (ament_python) runs this file with the grpcio-tools installed next to the grpcio and protobuf
  that will run the stubs (a stub from a newer grpcio-tools refuses to import beside an older runtime);
- ``pip install .`` (wheel) and ``pip install -e .`` (editable, PEP 660) get grpcio-tools from
  pyproject.toml's ``[build-system] requires``; the package's requirements then carry the runtime floors
  the generated code checks at import (``grpcio >= GRPC_GENERATED_VERSION``, protobuf >= the gencode's
  version, same major or the next one), read from the generated files themselves.

The worker and the client need no ROS: rclpy is imported only by ``sequence_ai_ros.node`` and
``sequence_ai_ros.bags.player``, which robots run from their ROS install.
"""

import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.develop import develop

PACKAGE = 'sequence_ai_ros'
HERE = os.path.dirname(os.path.abspath(__file__))
PROTO = os.path.join(PACKAGE, 'protocol', 'sequence_ai.proto')


def mypy_grpc_plugin() -> str | None:
    """Return mypy-protobuf's ``protoc-gen-mypy_grpc`` (typed stubs of the gRPC module), or None.

    Looked up on PATH (pip's isolated build puts its scripts there), then beside this Python. A dev venv
    has it (requirements-dev.txt pins mypy-protobuf); a robot's colcon build and a plain ``pip install .``
    may not, and then only ``sequence_ai_pb2_grpc.pyi`` is missing: the code runs the same.
    """
    found = shutil.which('protoc-gen-mypy_grpc')
    beside = os.path.join(os.path.dirname(sys.executable), 'protoc-gen-mypy_grpc')
    return found or (beside if os.access(beside, os.X_OK) else None)


def generate_stubs() -> None:
    """Run grpc_tools.protoc on the .proto when a stub is missing or older than it.

    Writes ``sequence_ai_pb2.py`` and its type stub ``sequence_ai_pb2.pyi`` (protoc's own ``--pyi_out``),
    ``sequence_ai_pb2_grpc.py``, and ``sequence_ai_pb2_grpc.pyi`` when :func:`mypy_grpc_plugin` finds
    mypy-protobuf's plugin.
    """
    proto = os.path.join(HERE, PROTO)
    base = proto[:-len('.proto')]
    plugin = mypy_grpc_plugin()
    outs = [base + '_pb2.py', base + '_pb2.pyi', base + '_pb2_grpc.py'] + ([base + '_pb2_grpc.pyi'] if plugin else [])
    if all(os.path.exists(out) and os.path.getmtime(out) >= os.path.getmtime(proto) for out in outs):
        return
    typed_grpc = [f'--plugin=protoc-gen-mypy_grpc={plugin}', '--mypy_grpc_out=.'] if plugin else []
    subprocess.check_call(
        [sys.executable, '-m', 'grpc_tools.protoc', '-I.', '--python_out=.', '--pyi_out=.', '--grpc_python_out=.',
         *typed_grpc, PROTO],
        cwd=HERE)


def runtime_floors() -> list[str]:
    """Return the grpcio and protobuf requirements that the generated stubs check when imported.

    Read from the stubs (``GRPC_GENERATED_VERSION`` and ``ValidateProtobufRuntimeVersion(..., major, minor,
    patch, ...)``), so they always match the grpcio-tools that generated them.
    """
    base = os.path.join(HERE, PACKAGE, 'protocol', 'sequence_ai_pb2')
    with open(base + '_grpc.py', encoding='utf-8') as f:
        grpc_version = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", f.read()).group(1)
    with open(base + '.py', encoding='utf-8') as f:
        nums = re.search(r'ValidateProtobufRuntimeVersion\(\s*[\w.]+,\s*(\d+),\s*(\d+),\s*(\d+)', f.read())
    major, minor, patch = (int(n) for n in nums.groups())
    return [f'grpcio>={grpc_version}', f'protobuf>={major}.{minor}.{patch},<{major + 2}']


# Runtime dependencies of the worker and client (ranges, not pins: the pins live in the requirements
# files per environment). Lower bounds admit the ROS distros' own packages (Humble: numpy 1.21, PyYAML
# 5.4, Pillow 9.0, tqdm 4.57); av stays below 16 beside LeRobot 0.6 through requirements-lerobot.txt.
REQUIRES = [
    'numpy>=1.21', 'PyYAML>=5.3', 'Pillow>=9.0', 'tqdm>=4.57', 'grpcio-health-checking>=1.62',
    'rosbags>=0.10', 'av>=12', 'pyarrow>=14',
]

# Optional features, ``pip install "sequence_ai_ros[metrics,plot]"`` (ranges; requirements*.txt pin them):
# metrics: ``seq serve --metrics-port``; plot: ``seq policy stats --plot`` and ``seq policy data plot``;
# sim: the simulated robot (sequence_ai_ros.sim; MuJoCo 4 breaks metaworld 3.0.0 at env build, gymnasium
# imports packaging without declaring it); lerobot: the lerobot template (LeRobot 0.6 needs Python >= 3.12; its own
# extras for diffusion and SmolVLA; pi0/pi0.5 add lerobot[pi]).
EXTRAS = {
    'metrics': ['prometheus_client>=0.17'],
    'plot': ['matplotlib>=3.5'],
    'sim': ['metaworld==3.0.0', 'mujoco==3.8.1', 'packaging'],
    'lerobot': ['lerobot[diffusion,smolvla]>=0.6.1,<0.7'],
    # OpenTelemetry tracing (seq serve --otlp-endpoint; sequence_ai_ros.protocol.tracing.configure on a robot)
    'tracing': ['opentelemetry-api>=1.45,<2', 'opentelemetry-sdk>=1.45,<2',
                'opentelemetry-exporter-otlp-proto-grpc>=1.45,<2'],
}


class BuildPy(build_py):
    def run(self):
        generate_stubs()
        super().run()


class Develop(develop):
    def run(self):
        generate_stubs()
        super().run()


def generated_requires() -> list[str]:
    """The stubs' runtime floors; the stubs are generated first when grpcio-tools is importable.

    ``setup.py`` runs more than once per install (metadata, then build); metadata needs the floors, so the
    stubs are generated as soon as this file runs. Without grpcio-tools (a bare ``setup.py --name``) it
    returns no floor rather than failing.
    """
    try:
        generate_stubs()
    except (subprocess.CalledProcessError, OSError):
        return []
    try:
        return runtime_floors()
    except (OSError, AttributeError):
        return []


def package_version() -> str:
    """The one version definition, ``__version__`` in sequence_ai_ros/__init__.py (read, not imported)."""
    with open(os.path.join(HERE, PACKAGE, '__init__.py'), encoding='utf-8') as f:
        return re.search(r"^__version__ = '([^']+)'", f.read(), re.M).group(1)


def data_files():
    files = [
        ('share/ament_index/resource_index/packages', ['resource/' + PACKAGE]),
        ('share/' + PACKAGE, ['package.xml']),
        ('share/' + PACKAGE + '/launch', glob.glob('launch/*.launch.py')),
        ('share/' + PACKAGE + '/config', glob.glob('config/*.yaml')),
    ]
    return [(d, f) for d, f in files if f]


setup(
    name=PACKAGE,
    version=package_version(),
    packages=find_packages(exclude=['test']),
    py_modules=['sequence_ai'],
    package_data={PACKAGE: ['py.typed', 'protocol/*.proto', 'protocol/*.pyi', 'templates/*/*', 'node/*.yaml',
                            'worker/haproxy.cfg']},
    include_package_data=True,
    data_files=data_files(),
    install_requires=['setuptools', *REQUIRES, *generated_requires()],
    extras_require=EXTRAS,
    python_requires='>=3.10',
    zip_safe=False,
    maintainer='sequence_ai maintainers',
    maintainer_email='maintainers@sequence-ai.dev',
    description='Drive a ROS 2 robot from a remote action-chunking policy over gRPC.',
    license='Apache-2.0',
    cmdclass={'build_py': BuildPy, 'develop': Develop},
    entry_points={
        'console_scripts': [
            'policy_node = sequence_ai_ros.node.entry:policy_node',
            'seq = sequence_ai_ros.cli:main',
            'bag_player = sequence_ai_ros.node.entry:bag_player',
            'sim_robot = sequence_ai_ros.sim.main:main',
        ],
    },
)
