"""glibc malloc tuning (sequence_ai_ros.malloc_tuning): applied once per process, SEQ_MALLOC_TUNING=0 turns it off."""

import os
import platform
import subprocess
import sys

import pytest

CODE = ('from sequence_ai_ros.malloc_tuning import tune_malloc\n'
        'print(tune_malloc(), tune_malloc())\n')


def _run(env_value: str | None) -> str:
    env = dict(os.environ)
    env.pop('SEQ_MALLOC_TUNING', None)
    if env_value is not None:
        env['SEQ_MALLOC_TUNING'] = env_value
    return subprocess.run([sys.executable, '-c', CODE], env=env, capture_output=True, text=True, check=True,
                          timeout=60).stdout.strip()


@pytest.mark.skipif(platform.libc_ver()[0] != 'glibc', reason='mallopt is glibc only')
def test_applied_on_glibc_and_idempotent():
    assert _run(None) == 'True True'


@pytest.mark.parametrize('value', ['0', 'off', 'false'])
def test_env_switch_turns_it_off(value):
    assert _run(value) == 'False False'
