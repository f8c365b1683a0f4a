"""TLS certificate failures said at once, and hints that name what to run."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from sequence_ai_ros.cli import main as seq_main
from sequence_ai_ros.client import connect
from sequence_ai_ros.exceptions import ConnectionLost
from sequence_ai_ros.worker import serve_policy_file

FAST = Path(__file__).resolve().parents[1] / 'policies' / 'fast.py'
#: well inside the 20 s connect timeout, generous under load: the messages below name the cause (the review
#: saw 5 s and then "is seq serve running")
BOUND_S = 10.0


def _cert(tmp_path: Path, name: str, san: str | None) -> tuple[Path, Path]:
    """A self-signed certificate with subject CN ``name`` and, unless None, subjectAltName ``san``."""
    if shutil.which('openssl') is None:
        pytest.skip('the openssl CLI is needed to make test certificates')
    cert, key = tmp_path / f'{name}.pem', tmp_path / f'{name}.key'
    subprocess.run(['openssl', 'req', '-x509', '-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:P-256', '-nodes',
                    '-keyout', str(key), '-out', str(cert), '-days', '1', '-subj', f'/CN={name}',
                    *(['-addext', f'subjectAltName={san}'] if san else [])], check=True, capture_output=True)
    return cert, key


def _refused(port: int, tls) -> tuple[str, float]:
    started = time.monotonic()
    with pytest.raises(ConnectionLost) as info:
        connect('fast', endpoint=f'127.0.0.1:{port}', tls=tls, timeout=20.0)
    return str(info.value), time.monotonic() - started


def test_a_certificate_failure_names_the_ca_or_the_host_at_once(tmp_path):
    cert, key = _cert(tmp_path, 'worker', 'DNS:localhost,IP:127.0.0.1')
    other, _ = _cert(tmp_path, 'other-ca', 'DNS:localhost,IP:127.0.0.1')
    with serve_policy_file(FAST, 'fast', dim=3, host='127.0.0.1', port=0, tls=(cert, key)) as server:
        with connect('fast', endpoint=f'127.0.0.1:{server.port}', tls=str(cert), timeout=20.0) as policy:
            assert policy.contract.action_names        # the right CA: served
        why, took = _refused(server.port, str(other))  # a wrong CA
        assert took < BOUND_S and 'not trusted by the CA in' in why and str(other) in why, (took, why)
        why, took = _refused(server.port, True)        # system roots against a self-signed certificate
        assert took < BOUND_S and 'system roots' in why and 'self-signed' in why, (took, why)
        assert 'is `seq serve` running' not in why

    cert, key = _cert(tmp_path, 'elsewhere', 'DNS:robot-gw.example')   # a certificate for another host
    with serve_policy_file(FAST, 'fast', dim=3, host='127.0.0.1', port=0, tls=(cert, key)) as server:
        why, took = _refused(server.port, str(cert))
        assert took < BOUND_S and "not valid for '127.0.0.1'" in why, (took, why)


def test_the_deploy_hint_names_the_policy_file_once(seq_home, capsys):
    """The review: a hint said ``seq deploy foo/policy.py/policy.py``."""
    assert seq_main(['delete', 'foo/policy.py']) != 0
    err = capsys.readouterr().err
    assert 'seq deploy foo/policy.py)' in err and 'policy.py/policy.py' not in err, err
    assert seq_main(['delete', 'foo']) != 0
    assert 'seq deploy foo/policy.py)' in capsys.readouterr().err


def test_a_certificate_naming_its_host_in_the_subject_alone_still_connects(tmp_path):
    """A certificate without subjectAltName whose CN is the host: gRPC accepts it, so the early check must."""
    cert, key = _cert(tmp_path, 'localhost', None)
    with serve_policy_file(FAST, 'fast', dim=3, host='127.0.0.1', port=0, tls=(cert, key)) as server:
        with connect('fast', endpoint=f'localhost:{server.port}', tls=str(cert), timeout=20.0) as policy:
            assert policy.contract.action_names
