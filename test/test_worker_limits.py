"""Worker limits on a real gRPC server: inference/load deadlines, hard policy failures, the stream cap.

Regression tests for the adversarial review of issue 3 (hung policies, SystemExit in a policy, idle
streams exhausting the handler pool, oversized chunks, seq deploy bounds, seq policy capture typos).
"""

from __future__ import annotations

import re
import signal
import textwrap
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_worker_support import POLICIES, Stream, channel, handshake, state_request, wait_for, wait_ready

from sequence_ai_ros.cli import main as seq_main
from sequence_ai_ros.exceptions import Overloaded
from sequence_ai_ros.protocol import errors as perrors
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.worker import create_server, serve_policy_file
from sequence_ai_ros.worker.registry import Registry, deploy

STUCK = POLICIES / 'worker_stuck.py'
FAST = POLICIES / 'fast.py'
NAMES = ['a', 'b']
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def stuck_req(rid: int, **params: str) -> pb.ObservationRequest:
    return state_request(rid, [0.5, -0.5], NAMES, params=params)


def release(server) -> None:
    """Let every hung Stuck instance of ``server`` return, so its threads end soon after the test."""
    for runtime in server.runtimes.values():
        for instance in getattr(runtime.definition.cls, 'instances', ()):
            instance.release.set()


def health_status(ch: grpc.Channel, service: str) -> int:
    return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_hung_inference_fails_typed_marks_deployment_failed_and_spares_others(seq_home: Path):
    deploy(STUCK, name='stuck')
    deploy(FAST, name='fast')
    server = create_server(home=seq_home, inference_timeout_s=0.4, isolation='none')  # the in-worker path
    ch = channel(server.port)
    try:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'stuck').ready and wait_ready(stub, 'fast').ready
        hung, queued = Stream(stub, 'stuck', 'hung'), Stream(stub, 'stuck', 'queued')
        assert hung.start().HasField('started') and queued.start().HasField('started')
        hung.send(observation=stuck_req(1, hang='30'))
        runtime = server.runtimes['stuck']          # in-worker: its instance is the worker's (isolation none)
        # the hung request holds the inference thread; this one waits behind it
        wait_for(lambda: runtime._instance.policy.hanging.is_set(), timeout=30, what='the hung inference')
        queued.send(observation=stuck_req(1))
        for stream in (hung, queued):
            reply = stream.recv(timeout=10)        # well inside the 30 s hang: cut at the 0.4 s deadline
            assert reply.HasField('error'), reply
            assert reply.error.code == pb.POLICY_EXCEPTION and reply.error.request_id == 1
            assert 'inference exceeded 0.4 s' in reply.error.message
        ready = stub.Ready(pb.ReadyRequest(deployment='stuck'), timeout=5)
        assert not ready.ready and ready.state == 'failed' and 'inference exceeded 0.4 s' in ready.message
        wait_for(lambda: health_status(ch, 'stuck') == NOT_SERVING, what='stuck NOT_SERVING')
        assert health_status(ch, '') == SERVING and health_status(ch, 'fast') == SERVING
        # The streams were not killed: a later request gets a typed NOT_READY, and the episode ends cleanly.
        reply = hung.ask(stuck_req(2))
        assert reply.error.code == pb.NOT_READY and 'inference exceeded' in reply.error.message
        assert hung.end().HasField('ended') and queued.end().HasField('ended')
        # Another deployment of the same worker still serves.
        other = Stream(stub, 'fast', 'other')
        assert other.start().HasField('started')
        reply = other.ask(state_request(1, [0.0] * 26, [f'j{i}' for i in range(26)]))
        assert reply.HasField('chunk') and reply.chunk.actions.shape == [30, 26]
        assert other.end().HasField('ended')
        handshake(stub, 'stuck')  # the unary path still answers
    finally:
        release(server)
        ch.close()
        server.stop(grace=0.5)


def test_a_hung_inference_nobody_waits_for_still_turns_ready_and_health_to_failed():
    server = serve_policy_file(STUCK, 'stuck', inference_timeout_s=0.3, isolation='none')
    ch = channel(server.port)
    try:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'stuck').ready
        stream = Stream(stub, 'stuck', 'gone')
        assert stream.start().HasField('started')
        stream.send(observation=stuck_req(1, hang='30'))
        runtime = server.runtimes['stuck']          # in-worker: its instance is the worker's (isolation none)
        wait_for(lambda: runtime._instance.policy.hanging.is_set(), timeout=30, what='the hung inference')
        stream.cancel()  # the robot is gone; the policy call still hangs
        reply = wait_for(lambda: _failed(stub), timeout=30, what='Ready to say failed')
        assert 'inference exceeded 0.3 s' in reply.message
        assert health_status(ch, 'stuck') == NOT_SERVING
    finally:
        release(server)
        ch.close()
        server.stop(grace=0.5)


def _failed(stub) -> pb.ReadyReply | None:
    reply = stub.Ready(pb.ReadyRequest(deployment='stuck'), timeout=5)
    return reply if reply.state == 'failed' else None


@pytest.mark.parametrize('params, text', [({'exit': '3'}, 'SystemExit: 3'),
                                          ({'interrupt': '1'}, 'KeyboardInterrupt: policy pressed ctrl-c')])
def test_system_exit_and_keyboard_interrupt_in_infer_are_policy_exceptions(params, text):
    with serve_policy_file(STUCK, 'stuck') as server, channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'stuck').ready
        stream = Stream(stub, 'stuck', 'e1')
        assert stream.start().HasField('started')
        reply = stream.ask(stuck_req(1, **params))
        assert reply.HasField('error') and reply.error.code == pb.POLICY_EXCEPTION, reply
        assert text in reply.error.message
        reply = stream.ask(stuck_req(2))  # the stream and the inference thread live on
        assert reply.HasField('chunk') and reply.chunk.request_id == 2
        assert stream.end().HasField('ended') and stream.error is None
        assert wait_ready(stub, 'stuck').ready


def test_hung_load_marks_the_deployment_failed_after_the_load_deadline():
    # the bound covers the policy file's import as well as load(): 3 s, so that an import on loaded cores fits
    server = serve_policy_file(STUCK, 'stuck', hang_load=30.0, load_timeout_s=3.0, isolation='none')
    ch = channel(server.port)
    try:
        stub = pb_grpc.PolicyServiceStub(ch)
        reply = wait_ready(stub, 'stuck', timeout=30)
        assert not reply.ready and reply.state == 'failed' and 'load exceeded 3 s' in reply.message
        assert health_status(ch, 'stuck') == NOT_SERVING
        stream = Stream(stub, 'stuck', 'e1')
        assert stream.start().HasField('started')
        reply = stream.ask(stuck_req(1))
        assert reply.error.code == pb.NOT_READY and 'load exceeded' in reply.error.message
        assert reply.error.retry_after_s == 0.0             # failed: waiting will not help
        stream.close()
    finally:
        release(server)
        ch.close()
        server.stop(grace=0.5)
    assert wait_for(lambda: not [t for t in threading.enumerate() if t.name == 'seq-load-stuck'],
                    what='the released loader to end')


def test_streams_over_max_streams_get_overloaded_while_unary_and_health_answer():
    with serve_policy_file(FAST, 'fast', max_streams=4) as server, channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'fast').ready
        streams = [Stream(stub, 'fast', f'idle{i}') for i in range(4)]
        for s in streams:
            assert s.start().HasField('started')
        extra = Stream(stub, 'fast', 'extra')
        refused = extra.start()   # the refusal is a reply, after EpisodeStart (a balancer resets an aborted call)
        err = perrors.from_error(refused.error)
        assert isinstance(err, Overloaded) and err.refusal == 'max_streams' and 'max_streams' in str(err)
        extra.close()
        assert extra.recv(timeout=10) is None and extra.error is None
        assert handshake(stub, 'fast').deployment == 'fast'
        assert stub.Ready(pb.ReadyRequest(deployment='fast'), timeout=5).ready
        assert health_status(ch, '') == SERVING and health_status(ch, 'fast') == SERVING
        assert streams[0].end().HasField('ended')
        late = wait_for(lambda: _opened(stub), what='a stream once one closed')
        assert late.end().HasField('ended')
        for s in streams[1:]:
            s.cancel()


def _opened(stub) -> Stream | None:
    s = Stream(stub, 'fast', f'late{time.monotonic_ns()}')
    reply = s.start()
    return s if reply is not None and reply.HasField('started') else None


def test_chunk_longer_than_chunk_length_is_an_in_stream_contract_violation():
    with serve_policy_file(STUCK, 'stuck') as server, channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'stuck').ready
        stream = Stream(stub, 'stuck', 'e1')
        assert stream.start().HasField('started')
        reply = stream.ask(stuck_req(1, long='5'))
        assert reply.error.code == pb.CONTRACT_VIOLATION and 'chunk_length 4' in reply.error.message
        reply = stream.ask(stuck_req(2, long='3'))  # shorter than the horizon is fine
        assert reply.HasField('chunk') and list(reply.chunk.actions.shape) == [3, 2]
        assert stream.end().HasField('ended') and stream.error is None


def test_long_client_strings_are_not_echoed_whole():
    with serve_policy_file(STUCK, 'stuck') as server, channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            handshake(stub, 'stuck', version='v' * 100_000)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert 'v' * 100 in info.value.details() and len(info.value.details()) < 400
        with pytest.raises(grpc.RpcError) as info:
            handshake(stub, 'd' * 100_000)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND and len(info.value.details()) < 400
        assert wait_ready(stub, 'stuck').ready
        stream = Stream(stub, 'stuck', 'e1')
        assert stream.start().HasField('started')
        req = stuck_req(1)
        req.images.add(key='k' * 100_000, encoding='raw', width=1, height=1, channels=3, data=bytes(3))
        reply = stream.ask(req)
        assert reply.error.code == pb.CONTRACT_VIOLATION and 'image.key' in reply.error.message   # the boundary's
        assert len(reply.error.message) < 400
        assert stream.end().HasField('ended')


HANGING_LOAD = '''
import time
from pathlib import Path

import numpy as np
import sequence_ai_ros.policy as seq


@seq.policy(action_space='joint_absolute', action_names=['x'], dt=0.1, chunk_length=2,
            observation=seq.ObservationContract(state_names=['x']))
class Hangs:
    def load(self):
        deadline = time.monotonic() + 20.0
        while not Path(__file__).with_name('release').exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    def infer(self, inp, episode):
        return np.zeros((2, 1), np.float32)
'''


def test_seq_deploy_dry_run_is_bounded(tmp_path: Path, seq_home: Path, capsys: pytest.CaptureFixture):
    folder = tmp_path / 'hangs'
    folder.mkdir()
    (folder / 'policy.py').write_text(HANGING_LOAD)
    try:
        started = time.monotonic()
        # the bound covers the policy file's import as well as load(): 3 s, so that an import on loaded cores fits
        assert seq_main(['deploy', str(folder / 'policy.py'), '--timeout', '3']) == 2
        assert time.monotonic() - started < 3 + 30      # the bound plus a start-up generous under load
        err = capsys.readouterr().err
        assert 'dry run exceeded 3 s while running load()' in err
        assert Registry(seq_home).list() == []
    finally:
        (folder / 'release').write_text('')
    assert wait_for(lambda: not [t for t in threading.enumerate() if t.name == 'seq-dry-run'],
                    what='the released dry run to end')


def test_seq_deploy_of_a_module_calling_sys_exit_is_a_deployment_error(tmp_path: Path, seq_home: Path,
                                                                       capsys: pytest.CaptureFixture):
    folder = tmp_path / 'quits'
    folder.mkdir()
    (folder / 'policy.py').write_text(textwrap.dedent('''
        import sys
        sys.exit(0)
    '''))
    assert seq_main(['deploy', str(folder / 'policy.py')]) == 2
    assert 'import failed: SystemExit: 0' in capsys.readouterr().err
    assert Registry(seq_home).list() == []


def test_policy_capture_refuses_an_unregistered_name_unless_forced(seq_home: Path, capsys: pytest.CaptureFixture):
    assert seq_main(['policy', 'capture', 'typo', '--rate', '1']) == 2
    err = capsys.readouterr().err
    assert "no deployment 'typo'" in err and '--force' in err
    assert not (seq_home / 'capture' / 'typo').exists()
    assert seq_main(['policy', 'capture', 'typo', '--rate', '1', '--force']) == 0
    assert (seq_home / 'capture' / 'typo' / 'settings.json').is_file()
    deploy(FAST, name='fast')
    assert seq_main(['policy', 'capture', 'fast', '--rate', '0.5']) == 0
    assert 'capture fast' in capsys.readouterr().out


@pytest.mark.slow
def test_seq_serve_flags_set_the_inference_deadline_and_the_stream_cap(processes):
    proc = processes.python('import sys; from sequence_ai_ros.cli.serving import main; sys.exit(main())',
                            'serve', str(STUCK), '--port', '0', '--warm', '--inference-timeout', '0.5',
                            '--isolation', 'none',
                            '--max-streams', '2')
    line = proc.stdout.readline()
    match = re.match(r'serving worker_stuck on 127\.0\.0\.1:(\d+)', line)
    assert match, (line, proc.stderr.read() if proc.poll() is not None else '')
    with channel(int(match.group(1))) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'worker_stuck').ready
        first, second = Stream(stub, 'worker_stuck', 'one'), Stream(stub, 'worker_stuck', 'two')
        assert first.start().HasField('started') and second.start().HasField('started')
        third = Stream(stub, 'worker_stuck', 'three')
        assert third.start().error.refusal == 'max_streams'
        third.close()
        reply = first.ask(stuck_req(1, hang='30'))
        assert reply.error.code == pb.POLICY_EXCEPTION and 'inference exceeded 0.5 s' in reply.error.message
        first.close()
        second.close()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0  # a stuck policy thread does not keep the worker from stopping


def test_a_request_over_its_contracts_size_is_refused_in_stream_by_its_size_on_the_wire():
    """The limit is checked on the size the request had on the wire (the stream's deserializer measures it)."""
    with serve_policy_file(STUCK, 'stuck') as server, channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'stuck').ready
        limit = server.runtimes['stuck'].max_message_bytes
        stream = Stream(stub, 'stuck', 'big')
        assert stream.start().HasField('started')
        reply = stream.ask(stuck_req(1, pad='x' * limit))
        assert reply.HasField('error') and reply.error.code == pb.CONTRACT_VIOLATION, reply
        size = int(re.search(r'(\d+) bytes exceeds', reply.error.message).group(1))
        wire = pb.EpisodeRequest(observation=stuck_req(1, pad='x' * limit)).ByteSize()
        assert limit < size == wire
        reply = stream.ask(stuck_req(2))                     # the stream goes on
        assert reply.HasField('chunk') and reply.chunk.request_id == 2
        assert stream.end().HasField('ended') and stream.error is None


@pytest.mark.parametrize('isolation', ['none', 'process'])
def test_a_stop_cuts_an_episode_at_once_while_its_request_waits_for_the_policy(isolation):
    """The robot gets the cut's NOT_READY and EpisodeEnded while its request's inference still hangs.

    Its chunk is never sent, and the result is counted discarded. The cut used to wait in the stream behind the
    inference: past the stop's grace the robot got no EpisodeEnded, only the call's UNAVAILABLE.
    """
    server = serve_policy_file(STUCK, 'stuck', host='127.0.0.1', port=0, isolation=isolation)
    ch = channel(server.port)
    stopping = threading.Thread(target=server.stop, kwargs={'grace': 5.0})
    try:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'stuck').ready
        runtime = server.runtimes['stuck']
        stream = Stream(stub, 'stuck', 'cut-while-inferring')
        assert stream.start().HasField('started')
        stream.send(observation=stuck_req(1, hang='30'))

        def inferring() -> bool:
            return any(s.active is not None and s.active.live.in_flight for s in server.servicer.episode_streams())

        wait_for(inferring, timeout=30, what='the request in its inference')
        stopping.start()
        reply = stream.recv(timeout=20)           # well inside the 30 s hang
        assert reply is not None and reply.HasField('error'), reply
        assert reply.error.code == pb.NOT_READY and 'shutting down' in reply.error.message
        ended = stream.recv(timeout=20)
        assert ended is not None and ended.HasField('ended') and ended.ended.episode_id == 'cut-while-inferring'
        for rid in (2, 3):            # sent after the cut, before the robot closes its side: counted, never run
            stream.send(observation=stuck_req(rid))
        stream.close()
        assert stream.recv(timeout=20) is None
    finally:
        release(server)
        if stopping.ident is None:
            stopping.start()
        stopping.join(30)
        ch.close()
    # a deployment process's call is counted as its answer (here: the process closed with the worker) comes
    wait_for(lambda: runtime.end_stats()['results_discarded_at_end'] == 1, what='the discarded result counted')
    assert runtime.end_stats()['requests_dropped_at_end'] == 2
    assert runtime.end_stats()['inferences_started_after_end'] == 0
