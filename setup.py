"""ament_python build of sequence_ai_ros.

The gRPC stubs are generated here, at build time, from the grpcio-tools installed next to the grpcio
and protobuf that will run them (a stub from a newer grpcio-tools refuses to import beside an older
runtime, e.g. Ubuntu's python3-grpcio for Humble/Jazzy).
"""

import glob
import os
import subprocess
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.develop import develop

PACKAGE = 'sequence_ai_ros'
HERE = os.path.dirname(os.path.abspath(__file__))
PROTO = os.path.join(PACKAGE, 'protocol', 'sequence_ai.proto')


def generate_stubs() -> None:
    """Run grpc_tools.protoc on the .proto when the stubs are missing or older than it."""
    proto = os.path.join(HERE, PROTO)
    out = proto.replace('.proto', '_pb2_grpc.py')
    if os.path.exists(out) and os.path.getmtime(out) >= os.path.getmtime(proto):
        return
    subprocess.check_call(
        [sys.executable, '-m', 'grpc_tools.protoc', '-I.', '--python_out=.', '--grpc_python_out=.',
         PROTO],
        cwd=HERE)


class BuildPy(build_py):
    def run(self):
        generate_stubs()
        super().run()


class Develop(develop):
    def run(self):
        generate_stubs()
        super().run()


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
    version='0.1.0',
    packages=find_packages(exclude=['test']),
    py_modules=['sequence_ai'],
    package_data={PACKAGE: ['py.typed', 'protocol/*.proto', 'templates/*/*', 'node/*.yaml']},
    include_package_data=True,
    data_files=data_files(),
    install_requires=['setuptools'],
    zip_safe=False,
    maintainer='sequence_ai maintainers',
    maintainer_email='maintainers@sequence-ai.dev',
    description='Drive a ROS 2 robot from a remote action-chunking policy over gRPC.',
    license='Apache-2.0',
    cmdclass={'build_py': BuildPy, 'develop': Develop},
    entry_points={
        'console_scripts': [
            'policy_node = sequence_ai_ros.node.main:main',
            'seq = sequence_ai_ros.cli:main',
            'bag_player = sequence_ai_ros.bags.player:main',
        ],
    },
)
