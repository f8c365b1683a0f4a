"""``ServerConfig``: one definition of every worker setting, whose defaults are ``seq serve``'s defaults."""

from __future__ import annotations

import argparse
import dataclasses
import math

import pytest
from test_worker_support import POLICIES

from sequence_ai_ros.cli import serving
from sequence_ai_ros.exceptions import ConfigError
from sequence_ai_ros.protocol import DEFAULT_PORT
from sequence_ai_ros.worker.config import RULES, ServerConfig
from sequence_ai_ros.worker.server import serve_policy_file


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog='seq')
    serving.add_parsers(parser.add_subparsers(dest='command', required=True), {})
    return parser.parse_args(['serve', *argv])


def test_cli_defaults_are_the_config_defaults():
    assert serving.server_config(serve_args('NAME')) == ServerConfig()
    assert ServerConfig().port == DEFAULT_PORT == 50551
    assert (ServerConfig().idle_timeout_s, ServerConfig().max_streams, ServerConfig().inference_timeout_s,
            ServerConfig().load_timeout_s, ServerConfig().warm) == (10.0, 256, 30.0, 180.0, False)


def test_cli_flags_fill_the_config(tmp_path):
    token = tmp_path / 'token'
    token.write_text('s3cret\n')
    cert, key = tmp_path / 'c.pem', tmp_path / 'k.pem'
    cert.write_text('cert')
    key.write_text('key')
    config = serving.server_config(serve_args(
        'NAME', '--host', '0.0.0.0', '--port', '0', '--idle-timeout', '7.5', '--warm', '--max-streams', '9',
        '--inference-timeout', '2', '--load-timeout', '3', '--token-file', str(token),
        '--tls-cert', str(cert), '--tls-key', str(key), '--max-pending', '200', '--drain-timeout', '3'))
    assert config == ServerConfig(host='0.0.0.0', port=0, idle_timeout_s=7.5, warm=True, max_streams=9,
                                  inference_timeout_s=2.0, load_timeout_s=3.0, token='s3cret',
                                  tls=(str(cert), str(key)), max_pending=200, drain_timeout_s=3.0)
    with pytest.raises(ConfigError, match='go together'):
        serving.server_config(serve_args('NAME', '--tls-cert', 'c.pem'))
    # a file that is not there is named with its flag, before the worker starts
    with pytest.raises(ConfigError, match='--tls-key .*missing.pem'):
        serving.server_config(serve_args('NAME', '--tls-cert', str(cert), '--tls-key', str(tmp_path / 'missing.pem')))
    with pytest.raises(ConfigError, match='--token-file'):
        serving.server_config(serve_args('NAME', '--token-file', str(tmp_path)))


@pytest.mark.parametrize('field,value,match', [
    ('idle_timeout_s', 0, r'idle_timeout_s \(--idle-timeout\) must be a finite number of seconds > 0'),
    ('idle_timeout_s', float('inf'), r'idle_timeout_s \(--idle-timeout\)'), ('idle_timeout_s', True, 'idle_timeout_s'),
    ('inference_timeout_s', -1.0, 'inference_timeout_s'),
    ('load_timeout_s', float('nan'), 'load_timeout_s'), ('max_streams', 0, 'max_streams .* must be an integer >= 1'),
    ('max_streams', True, 'max_streams'), ('max_pending', 1.5, 'max_pending'), ('port', 70000, 'port .*must be in'),
    ('port', True, 'port'), ('host', '', r'host \(--host\) must name an address'), ('warm', 'yes', 'warm'),
    ('token', '', 'token must not be empty'),
])
def test_invalid_settings_are_refused_at_construction(field, value, match):
    with pytest.raises(ConfigError, match=match):
        ServerConfig(**{field: value})


#: Values just outside each rule of :data:`RULES` (a new rule needs its probes here).
OUTSIDE = {
    'address': ['', '  ', None],
    'port': [-1, 65536, True, 1.0, None],
    'optional_port': [-1, 65536, True, '9000'],
    'seconds': [0, -1e-9, math.inf, math.nan, True, '5'],
    'count': [0, True, 1.5],
    'count_or_0': [-1, True, 0.5],
    'flag': ['yes', 1, None],
    'token': ['', 7],
    'tls': [('c.pem',), 'c.pem', ('c.pem', 'k.pem', 'x')],
    'optional_path': ['', '  ', 7, 'a\0b'],
    'isolation': ['thread', '', None],
    'rollout': ['now', '', None, 'Cut'],
}


def test_every_setting_is_checked_by_its_fields_rule():
    """No setting is listed by hand: each field names its rule, and a value just outside it is refused naming it."""
    assert set(OUTSIDE) == set(RULES)
    for field in dataclasses.fields(ServerConfig):
        rule = field.metadata['rule']        # KeyError: a field declared without a rule
        for value in OUTSIDE[rule]:
            with pytest.raises(ConfigError, match=rf'^{field.name}\b'):
                ServerConfig(**{field.name: value})
    with pytest.raises(ConfigError) as info:
        ServerConfig(token='')
    assert "got" not in str(info.value)                                  # a token is never echoed


def test_embedded_binds_a_free_port_and_rejects_unknown_settings():
    assert ServerConfig.embedded() == dataclasses.replace(ServerConfig(), port=0)
    assert ServerConfig.embedded(port=123).port == 123
    with pytest.raises(ConfigError, match="unknown server settings \\['prot'\\]"):
        ServerConfig.embedded(prot=1)


def test_serve_policy_file_splits_server_settings_from_policy_kwargs():
    config = ServerConfig.embedded(max_streams=3)
    with serve_policy_file(POLICIES / 'worker_echo.py', 'echo', config, idle_timeout_s=9.0,
                           hook_log='/dev/null') as server:
        assert server.config.max_streams == 3 and server.config.idle_timeout_s == 9.0 and server.port > 0
        assert server.servicer.max_streams == 3 and server.servicer.idle_timeout_s == 9.0


def test_fleet_and_admission_flags_fill_the_config():
    config = serving.server_config(serve_args(
        'NAME', '--proxy-socket', '/run/seq/replica1.sock', '--metrics-port', '0',
        '--agent-port', '9101', '--start-timeout', '2.5', '--max-streams-per-client', '0'))
    assert config == ServerConfig(proxy_socket='/run/seq/replica1.sock', metrics_port=0, agent_port=9101,
                                  start_timeout_s=2.5, max_streams_per_client=0)
    defaults = ServerConfig()
    assert (defaults.proxy_socket, defaults.metrics_port, defaults.agent_port, defaults.start_timeout_s,
            defaults.max_streams_per_client) == (None, None, None, 5.0, 64)
    with pytest.raises(ConfigError, match='agent_port'):
        ServerConfig(agent_port=-1)


def test_anonymous_streams_need_a_token_and_leave_headroom(tmp_path):
    (tmp_path / 'token').write_text('s3cret\n')
    config = serving.server_config(serve_args('NAME', '--token-file', str(tmp_path / 'token'),
                                              '--anonymous-streams', '16', '--max-streams', '64'))
    assert (config.token, config.anonymous_streams, config.max_streams) == ('s3cret', 16, 64)
    assert ServerConfig().anonymous_streams == 0
    with pytest.raises(ConfigError, match=r'anonymous_streams \(--anonymous-streams\) needs a token'):
        ServerConfig(anonymous_streams=4)
    with pytest.raises(ConfigError, match='must be below max_streams'):
        ServerConfig(token='t', anonymous_streams=8, max_streams=8)
    with pytest.raises(ConfigError, match='integer >= 0'):
        ServerConfig(token='t', anonymous_streams=-1)


def test_an_address_that_cannot_be_bound_is_a_config_error_naming_the_flags():
    with pytest.raises(ConfigError, match=r'cannot bind not\.\.a\.\.host:0 \(--host/--port\)'):
        serve_policy_file(POLICIES / 'fast.py', deployment='fast', host='not..a..host', port=0)
