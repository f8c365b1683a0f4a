"""The documentation: ``mkdocs build --strict`` passes, every typed error is explained, user documents speak to users.

The build is the real one (mkdocs.yml, docs/hooks.py, mkdocstrings reading the docstrings), into a temporary
folder, so a broken link or anchor, a page missing from the nav, a stale API reference, a metric the metrics
module does not document or an exception without a troubleshooting section fails here.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / 'docs'
#: What a user document (README, docs/, a template's README) never says: development history and machine notes.
NOT_FOR_USERS = (r'\bissues? ?#?\d+', r'\bissue-\d+', r'\bthis (2-core |shared |quiet )?(machine|VM)\b',
                 r'\bthis \d-core\b', r'\bbefore this change\b', r'\bbefore these cuts\b', r'\bother sessions\b',
                 r'\bfresh-user trial\b')


def _hooks():
    spec = importlib.util.spec_from_file_location('docs_hooks', DOCS / 'hooks.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def user_documents() -> list[Path]:
    return [REPO / 'README.md', REPO / 'CHANGELOG.md', *sorted(DOCS.rglob('*.md')),
            *sorted((REPO / 'sequence_ai_ros' / 'templates').glob('*/README.md'))]


def test_mkdocs_build_strict_passes(tmp_path):
    pytest.importorskip('mkdocs', reason='mkdocs is pinned in requirements-docs.txt (make setup installs it)')
    env = dict(os.environ, NO_MKDOCS_2_WARNING='1')
    done = subprocess.run([sys.executable, '-m', 'mkdocs', 'build', '--strict', '--site-dir', str(tmp_path / 'site')],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    api = (tmp_path / 'site' / 'reference' / 'api' / 'index.html').read_text()
    assert 'wait_until_ready' in api and 'LeRobotRobot' in api and 'SequencePolicy' in api   # from the docstrings
    params = (tmp_path / 'site' / 'reference' / 'parameters' / 'index.html').read_text()
    assert 'control_rate_hz' in params and 'safety.max_step' in params


def test_every_exception_class_has_a_troubleshooting_section():
    pytest.importorskip('mkdocs', reason='docs/hooks.py uses mkdocs (requirements-docs.txt)')
    hooks = _hooks()
    names = [c.__name__ for c in hooks.exception_classes()]
    assert 'SequenceAIError' in names and 'ContractViolation' in names and len(names) >= 16
    assert hooks.undocumented_exceptions((DOCS / 'troubleshooting.md').read_text()) == []


def test_every_template_has_a_page_and_every_page_is_in_the_nav():
    nav = (REPO / 'mkdocs.yml').read_text()
    for template in sorted((REPO / 'sequence_ai_ros' / 'templates').glob('*/README.md')):
        page = DOCS / 'policy-templates' / f'{template.parent.name}.md'
        assert page.read_text().strip() == f'--8<-- "{template.relative_to(REPO)}"', page
    for page in DOCS.rglob('*.md'):
        assert str(page.relative_to(DOCS)) in nav, f'{page} is not in mkdocs.yml nav'


def test_user_documents_speak_to_users():
    found = []
    for doc in user_documents():
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            found += [f'{doc.relative_to(REPO)}:{n}: {line.strip()}' for pattern in NOT_FOR_USERS
                      if re.search(pattern, line, re.I)]
    assert found == []


def test_readme_is_a_manual_of_at_most_250_lines_with_the_quickstart():
    readme = (REPO / 'README.md').read_text()
    assert len(readme.splitlines()) <= 250
    for step in ('make demo', 'make test', 'seq init hold my_policy', 'seq serve my_policy',
                 'python examples/fake_robot.py my_policy',
                 'ros2 launch sequence_ai_ros policy.launch.py model:=my_policy params_file:=config/g1.yaml',
                 'ros2 run sequence_ai_ros bag_player out/episode_5_bag --loop',
                 'ros2 action send_goal --feedback /policy_node/act sequence_ai_msgs/action/Act'):
        assert step in readme, step
