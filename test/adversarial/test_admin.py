"""Break-it: the admin API (``sequence_ai.v1.Admin``) against callers that must not use it, and against a flood.

- With a token, every admin call without it (no metadata, a wrong token, a token-less caller the worker lets
  hold episode streams under ``--anonymous-streams``) is UNAUTHENTICATED, and nothing changes (no drain,
  same log level); the probe port has no admin service at all.
- Without a token: reads from the worker's host only (a call through the balancer's proxy socket is a
  robot's: PERMISSION_DENIED), Drain and SetLogLevel from nobody, unless ``--admin-without-token``.
- 200 calls at once from one identity: at most the burst plus the refill over the measured time are
  answered, the others refused RESOURCE_EXHAUSTED with the refusal ``admin_rate``; another identity is not
  affected, and refused calls of a caller without the token spend nothing. The bucket's arithmetic on a
  given clock, and the bound on the identities kept.

Counts and values, never rates: the bound is checked against the time the calls measurably took.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from pathlib import Path

import grpc
import pytest
from test_worker_support import POLICIES, channel, wait_ready

from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.worker import serve_policy_file
from sequence_ai_ros.worker.admin import ADMIN_BURST, ADMIN_RATE_PER_S, TokenBuckets

FAST = POLICIES / 'fast.py'
TOKEN = 'adm1n-t0ken'
AUTH = (('authorization', f'Bearer {TOKEN}'),)


def _every_call(admin: pb_grpc.AdminStub, metadata=()) -> dict[str, grpc.StatusCode]:
    """Each admin method once with ``metadata``: its status code (OK when it answered)."""
    calls = {'ListEpisodes': lambda: admin.ListEpisodes(pb.ListEpisodesRequest(), metadata=metadata, timeout=10),
             'Stats': lambda: admin.Stats(pb.StatsRequest(), metadata=metadata, timeout=10),
             'ListVersions': lambda: admin.ListVersions(pb.ListVersionsRequest(), metadata=metadata, timeout=10),
             'SetLogLevel': lambda: admin.SetLogLevel(pb.SetLogLevelRequest(level='debug'), metadata=metadata,
                                                      timeout=10),
             'Drain': lambda: admin.Drain(pb.DrainRequest(), metadata=metadata, timeout=10)}
    codes = {}
    for name, call in calls.items():
        try:
            call()
            codes[name] = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            codes[name] = exc.code()
    return codes


def test_with_a_token_every_admin_call_without_it_is_refused_and_the_probe_port_has_no_admin():
    root = logging.getLogger()
    level = root.level
    server = serve_policy_file(FAST, 'fast', dim=3, host='127.0.0.1', port=0, token=TOKEN, anonymous_streams=4,
                               probe_port=0)
    try:
        admin = pb_grpc.AdminStub(channel(server.port))
        for metadata in ((), (('authorization', 'Bearer wrong'),), (('authorization', TOKEN),)):
            codes = _every_call(admin, metadata)
            assert set(codes.values()) == {grpc.StatusCode.UNAUTHENTICATED}, (metadata, codes)
        assert not server.servicer.drain.draining and root.level == level   # nothing changed
        probe = _every_call(pb_grpc.AdminStub(channel(server.probe_port)), AUTH)
        assert set(probe.values()) == {grpc.StatusCode.UNIMPLEMENTED}, probe
        assert not server.servicer.drain.draining
        reads = _every_call(admin, AUTH)
        assert reads['ListEpisodes'] == reads['Stats'] == reads['ListVersions'] == grpc.StatusCode.OK
    finally:
        root.setLevel(level)
        server.stop(grace=0.5)


def test_without_a_token_reads_answer_this_host_only_and_mutations_need_admin_without_token(tmp_path: Path):
    root = logging.getLogger()
    level = root.level
    sock = tmp_path / 'proxy.sock'
    server = serve_policy_file(FAST, 'fast', dim=3, host='127.0.0.1', port=0, proxy_socket=str(sock))
    try:
        codes = _every_call(pb_grpc.AdminStub(channel(server.port)))
        assert codes == {'ListEpisodes': grpc.StatusCode.OK, 'Stats': grpc.StatusCode.OK,
                         'ListVersions': grpc.StatusCode.OK, 'SetLogLevel': grpc.StatusCode.PERMISSION_DENIED,
                         'Drain': grpc.StatusCode.PERMISSION_DENIED}, codes
        with grpc.insecure_channel(f'unix:{sock}') as proxied:    # a robot through the balancer
            codes = _every_call(pb_grpc.AdminStub(proxied), (('x-forwarded-for', '127.0.0.1'),))
        assert set(codes.values()) == {grpc.StatusCode.PERMISSION_DENIED}, codes
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.AdminStub(channel(server.port)).Drain(pb.DrainRequest(), timeout=10)
        assert '--admin-without-token' in refused.value.details() and '--token-file' in refused.value.details()
        assert not server.servicer.drain.draining and root.level == level
    finally:
        server.stop(grace=0.5)
    opened = serve_policy_file(FAST, 'fast', dim=3, host='127.0.0.1', port=0, admin_without_token=True)
    try:
        admin = pb_grpc.AdminStub(channel(opened.port))
        assert admin.SetLogLevel(pb.SetLogLevelRequest(level='warning'), timeout=10).level == 'warning'
        assert not admin.Drain(pb.DrainRequest(), timeout=10).already_draining
        assert opened.wait(timeout=30), 'the drained worker did not stop'
    finally:
        root.setLevel(level)
        opened.stop(grace=0.5)


def test_admin_calls_are_rate_bounded_per_identity():
    server = serve_policy_file(FAST, 'fast', dim=3, host='127.0.0.1', port=0, token=TOKEN, warm=True)
    try:
        ch = channel(server.port)
        wait_ready(pb_grpc.PolicyServiceStub(ch), 'fast', timeout=30, metadata=AUTH)
        admin = pb_grpc.AdminStub(ch)
        for _ in range(3 * ADMIN_BURST):      # refused for want of the token: no bucket is spent
            with pytest.raises(grpc.RpcError) as unauthenticated:
                admin.Stats(pb.StatsRequest(), timeout=10)
            assert unauthenticated.value.code() == grpc.StatusCode.UNAUTHENTICATED
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(admin.Stats.with_call, pb.StatsRequest(), metadata=AUTH, timeout=30)
                       for _ in range(200)]
            answered, refused = 0, []
            for future in futures:
                try:
                    future.result()
                    answered += 1
                except grpc.RpcError as exc:
                    refused.append(exc)
        elapsed = time.monotonic() - started
        assert answered + len(refused) == 200
        assert ADMIN_BURST <= answered <= ADMIN_BURST + ADMIN_RATE_PER_S * elapsed + 1, (answered, elapsed)
        assert refused, 'nothing was refused'
        for exc in refused:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and exc.details().startswith('[OVERLOADED]')
            assert ('x-refusal', 'admin_rate') in tuple(exc.trailing_metadata() or ())
        # the robots' service is not rate-bounded by it
        assert pb_grpc.PolicyServiceStub(ch).Ready(pb.ReadyRequest(deployment='fast'), metadata=AUTH,
                                                   timeout=10).ready
    finally:
        server.stop(grace=0.5)


def test_a_token_bucket_refills_at_its_rate_and_keeps_a_bounded_number_of_identities():
    now = [100.0]
    buckets = TokenBuckets(burst=3, rate_per_s=2.0, max_keys=4, clock=lambda: now[0])
    assert [buckets.take('a') for _ in range(4)] == [True, True, True, False]
    assert buckets.take('b')                      # another identity has its own bucket
    now[0] += 0.5                                 # one token back
    assert buckets.take('a') and not buckets.take('a')
    now[0] += 60.0                                # never more than the burst
    assert [buckets.take('a') for _ in range(4)] == [True, True, True, False]
    for k in range(100):
        buckets.take(f'addr:10.0.0.{k}')
    assert len(buckets) == 4
    with pytest.raises(ValueError):
        TokenBuckets(burst=0)


def test_seq_admin_refuses_a_port_grpc_would_wrap_and_files_it_cannot_read(tmp_path):
    """A port over 65535 would reach another replica (116397 is 50861 to gRPC); a missing token file is named."""
    import argparse

    from sequence_ai_ros.cli.admin import endpoints
    from sequence_ai_ros.cli.files import read_token
    from sequence_ai_ros.exceptions import ConfigError

    for bad in ('127.0.0.1:116397', '127.0.0.1:0', 'nohost', ':50551', '127.0.0.1:5a'):
        with pytest.raises(ConfigError, match='1..65535'):
            endpoints(argparse.Namespace(endpoint=[bad], replicas=None))
    assert endpoints(argparse.Namespace(endpoint=['127.0.0.1:65535'], replicas=None)) == ['127.0.0.1:65535']
    binary = tmp_path / 'token.bin'
    binary.write_bytes(b'\xff\xfe\x00')
    for path, why in ((tmp_path / 'none', 'No such file'), (tmp_path, 'directory'), (binary, 'not a text file')):
        with pytest.raises(ConfigError, match=why):
            read_token(str(path))
