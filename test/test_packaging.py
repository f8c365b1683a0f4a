"""Packaging checks: rosdep keys, pinned requirements, entry points, the sequence_ai alias, the Makefile.

The system-ROS branch of the Makefile cannot run here (no ROS distro is installed), so it is checked
statically: ``make -n`` prints what it would run.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_package_xml_declares_every_runtime_dependency():
    root = ET.parse(REPO / 'package.xml').getroot()
    assert root.get('format') == '3'
    deps = {e.text for e in root.iter('exec_depend')}
    needed = {'rclpy', 'sensor_msgs', 'std_msgs', 'std_srvs', 'trajectory_msgs', 'geometry_msgs', 'diagnostic_msgs',
              'action_msgs', 'sequence_ai_msgs', 'python3-grpcio', 'python3-protobuf', 'python3-numpy',
              'python3-yaml'}
    assert needed <= deps, needed - deps
    assert root.find('export/build_type').text == 'ament_python'
    msg = ET.parse(REPO / 'msg' / 'package.xml').getroot()
    assert msg.find('name').text == 'sequence_ai_msgs'
    assert msg.find('member_of_group').text == 'rosidl_interface_packages'


def test_package_xml_declares_the_launch_and_test_tools():
    """Launch files (installed) need launch, launch_ros, ros2launch; the tests, launch_testing and ros2cli verbs."""
    root = ET.parse(REPO / 'package.xml').getroot()
    assert list(REPO.glob('launch/*.launch.py')), 'no launch files: drop this check with them'
    exec_deps = {e.text for e in root.iter('exec_depend')}
    assert {'launch', 'launch_ros', 'ros2launch'} <= exec_deps, {'launch', 'launch_ros', 'ros2launch'} - exec_deps
    test_deps = {e.text for e in root.iter('test_depend')}
    needed = {'launch_testing', 'launch_testing_ros', 'ros2cli', 'ros2action', 'ros2lifecycle', 'ros2param',
              'ros2service'}
    assert needed <= test_deps, needed - test_deps
    assert not exec_deps & test_deps, exec_deps & test_deps      # a run-time dependency is not also a test one


def test_requirements_are_pinned():
    names = sorted(p.name for p in REPO.glob('requirements*.txt'))
    assert {'requirements.txt', 'requirements-dev.txt', 'requirements-lerobot.txt'} <= set(names)
    for name in names:
        for line in (REPO / name).read_text().splitlines():
            line = line.split('#')[0].strip()
            if line and not line.startswith('-r'):
                pin = r'[A-Za-z0-9_.\-]+(\[[a-z,_\-]+\])?==[0-9][0-9A-Za-z.\-]*'
                marker = r'(; python_version [<>=]+ "3\.\d+")?'
                assert re.fullmatch(pin + marker, line), f'{name}: {line!r} is not pinned'


def test_console_scripts_point_at_real_main_functions():
    tree = ast.parse((REPO / 'setup.py').read_text())
    scripts = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
               and re.fullmatch(r'\w+ = [\w.]+:\w+', n.value)]
    assert {s.split(' = ')[0] for s in scripts} >= {'policy_node', 'seq', 'bag_player'}
    for script in scripts:
        module, func = script.split(' = ')[1].split(':')
        assert callable(getattr(importlib.import_module(module), func)), script


def test_sequence_ai_alias_exposes_the_client_api():
    import sequence_ai
    import sequence_ai_ros.client

    assert sequence_ai.connect is sequence_ai_ros.client.connect
    assert sequence_ai.RunOutcome is sequence_ai_ros.client.RunOutcome
    assert {'connect', 'Observation', 'Action'} <= set(sequence_ai.__all__)


def _dry_run(target: str, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k != 'ROS_DISTRO'}
    environ.update(env)
    done = subprocess.run(['make', '-n', '-B', target], cwd=REPO, env=environ, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_makefile_uses_a_sourced_ros_distro_instead_of_the_wheels():
    system = _dry_run('setup', ROS_DISTRO='humble')
    assert '--system-site-packages' in system
    # the distro's own pins (its numpy), and a pytest below 9: a distro's launch_testing may declare the pytest
    # hook argument pytest 9 removed, which stops every run before collection
    assert 'requirements-dev.txt' not in system and '-r requirements-humble.txt' in system
    assert re.search(r'\bpytest==8\.\d+\.\d+\b', system), system
    assert '-r requirements.txt' in _dry_run('setup', ROS_DISTRO='rolling')     # a distro without a file of its own
    wheels = _dry_run('setup')
    assert '-r requirements-dev.txt' in wheels and '--system-site-packages' not in wheels
    assert '/opt/python/cp311-cp311' in wheels   # the CMake path rewrite of the wheels (pitfall 1)
    build = _dry_run('build', ROS_DISTRO='jazzy')
    assert '--base-paths msg .' in build and 'AMENT_PREFIX_PATH' not in build


def test_ci_runs_exactly_the_readme_test_command():
    ci = (REPO / '.ci' / 'run').read_text()
    assert re.search(r'^make test$', ci, re.M)
    assert 'make test' in (REPO / 'README.md').read_text()


def test_check_lerobot_skips_without_python_312_saying_why():
    """LeRobot >= 0.5 needs Python >= 3.12: with an older interpreter the target skips, naming the reason."""
    environ = {k: v for k, v in os.environ.items() if k != 'ROS_DISTRO'}
    done = subprocess.run(['make', '--no-print-directory', 'check-lerobot', 'LEROBOT_PYTHON=python3.11'],
                          cwd=REPO, env=environ, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert 'check-lerobot: SKIPPED: LeRobot >= 0.5 needs Python >= 3.12' in done.stdout
    ci = (REPO / '.ci' / 'run').read_text()
    assert ci.index('make test') < ci.index('make check-lerobot')


def test_extras_cover_the_optional_features_at_the_versions_the_requirements_pin():
    """Each extra's range admits the version CI pins for it (one name, one version; requirements*.txt)."""
    from packaging.requirements import Requirement

    tree = ast.parse((REPO / 'setup.py').read_text())
    extras = next(ast.literal_eval(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == 'EXTRAS' for t in n.targets))
    assert set(extras) == {'metrics', 'plot', 'sim', 'lerobot', 'tracing'}
    pins: dict[str, list[str]] = {}
    for name in ('requirements.txt', 'requirements-lerobot.txt', 'requirements-dev.txt'):
        for line in (REPO / name).read_text().splitlines():
            line = line.split('#')[0].strip()
            if line and not line.startswith('-'):      # '-r other.txt': read on its own
                req = Requirement(line)
                pins.setdefault(req.name.lower().replace('_', '-'), []).append(str(req.specifier).lstrip('='))
    for extra, reqs in extras.items():
        for text in reqs:
            req = Requirement(text)
            versions = pins.get(req.name.lower().replace('_', '-'))
            assert versions, f'[{extra}] {req.name} is pinned in no requirements file'
            for version in versions:
                assert req.specifier.contains(version), f'[{extra}] {text} refuses the pinned {version}'
    readme = (REPO / 'README.md').read_text()
    assert 'sequence_ai_ros[metrics,plot]' in readme and '[sim]' in readme and '[lerobot]' in readme
    assert '[tracing]' in readme


def test_policy_node_without_ros_prints_one_line_and_exits_2():
    """An interpreter without site-packages has no rclpy: the console scripts say how to get ROS 2."""
    import sys

    env = {'PATH': os.environ.get('PATH', ''), 'PYTHONPATH': str(REPO)}
    for script in ('policy_node', 'bag_player'):
        code = f'import sys; from sequence_ai_ros.node.entry import {script}; sys.exit({script}())'
        done = subprocess.run([sys.executable, '-S', '-c', code], capture_output=True, text=True, env=env,
                              timeout=60, cwd=REPO)
        assert done.returncode == 2, done.stderr
        assert done.stdout == ''
        assert done.stderr.splitlines() == [
            f"{script}: needs ROS 2 (no module named 'rclpy'): install ROS 2 (Humble, Jazzy or Kilted) and source "
            "it (source /opt/ros/<distro>/setup.bash), then your workspace (source install/setup.bash)"], done.stderr


def test_a_missing_module_that_is_not_ros_still_raises():
    import pytest

    from sequence_ai_ros.node.entry import no_ros_hint, run_with_ros

    def load():
        raise ModuleNotFoundError("No module named 'numpy'", name='numpy')

    with pytest.raises(ModuleNotFoundError):
        run_with_ros('policy_node', load)
    assert run_with_ros('policy_node', lambda: lambda: None) == 0
    assert 'source install/setup.bash' in no_ros_hint('policy_node', 'sequence_ai_msgs')


def test_check_sim_skips_without_python_312_saying_why():
    """check-sim trains and serves with LeRobot too: the same skip, and CI runs it after check-lerobot."""
    environ = {k: v for k, v in os.environ.items() if k != 'ROS_DISTRO'}
    done = subprocess.run(['make', '--no-print-directory', 'check-sim', 'LEROBOT_PYTHON=python3.11'],
                          cwd=REPO, env=environ, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert 'check-sim: SKIPPED: LeRobot >= 0.5 needs Python >= 3.12' in done.stdout
    ci = (REPO / '.ci' / 'run').read_text()
    assert ci.index('make check-lerobot') < ci.index('make check-sim')


def test_the_version_is_defined_once_and_package_xml_repeats_it():
    """``sequence_ai_ros.__version__`` is the version; setup.py reads it, both package.xml files repeat it."""
    import sequence_ai_ros

    root = Path(__file__).resolve().parent.parent
    for xml in (root / 'package.xml', root / 'msg' / 'package.xml'):
        assert re.search(r'<version>([^<]+)</version>', xml.read_text()).group(1) == sequence_ai_ros.__version__, xml
    assert "version=package_version()" in (root / 'setup.py').read_text()
    assert f'## [{sequence_ai_ros.__version__}]' in (root / 'CHANGELOG.md').read_text()


def test_the_long_sim_targets_skip_without_python_312_and_stay_out_of_ci():
    """The flywheel, the image ACT's training and rtc-sim (tens of minutes each) skip like check-sim; CI runs none."""
    environ = {k: v for k, v in os.environ.items() if k != 'ROS_DISTRO'}
    for target in ('flywheel', 'train-image-act', 'rtc-sim'):
        done = subprocess.run(['make', '--no-print-directory', target, 'LEROBOT_PYTHON=python3.11'],
                              cwd=REPO, env=environ, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        assert 'SKIPPED: LeRobot >= 0.5 needs Python >= 3.12' in done.stdout, target
        assert f'make {target}' not in (REPO / '.ci' / 'run').read_text()
