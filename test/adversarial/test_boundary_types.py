"""Types at the boundary: values that are no real numbers, counts past any episode, bodies that do not decode.

Each test reproduces a case from the break-it review (issue 36, tenancy) against the real parts (a worker on
loopback gRPC, the real client, both adapters, the codec) and asserts the outcome now holds:

- complex, string, bool and object values are refused by ``pack_chunk``, the codec, the Observation and both
  adapters with a typed error (:class:`~sequence_ai_ros.protocol.codec.ValueKindViolation`) naming the field:
  a complex chunk was cut to its real part with only a ComplexWarning, the openpi adapter took complex,
  string and bool states, the LeRobot adapter read True as 1.0 and '1.5' as 1.5;
- an EpisodeEnd count past :data:`~sequence_ai_ros.protocol.limits.MAX_END_COUNT` (``underruns = 2**32-1``
  added 4.29e9 to ``seq_client_underruns_total``) is refused, naming it, and moves no counter;
- an undecodable unary request (Handshake, Ready, Label) gets INVALID_ARGUMENT naming the message, not UNKNOWN.
"""

from __future__ import annotations

import urllib.request
import warnings
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import serving
from test_worker_support import Stream, channel, handshake, state_request, wait_ready

import sequence_ai
from sequence_ai_ros.adapters.lerobot_robot import LeRobotRobot
from sequence_ai_ros.exceptions import ContractViolation
from sequence_ai_ros.protocol import codec, limits, messages
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.protocol.codec import ValueKindViolation
from sequence_ai_ros.protocol.contract import Contract, ObservationContract
from sequence_ai_ros.protocol.spaces import ActionSpace
from sequence_ai_ros.protocol.types import Action, Observation
from sequence_ai_ros.worker import serve_policy_file

POLICIES = Path(__file__).resolve().parents[1] / 'policies'
prom_parser = pytest.importorskip('prometheus_client.parser', reason='prometheus_client is not installed')

#: (kind in words, a (2, 3) value of that kind)
KINDS = [
    ('complex', np.full((2, 3), 1 + 2j)),
    ('string', np.full((2, 3), '1.5')),
    ('bool', np.ones((2, 3), bool)),
    ('object', np.full((2, 3), None, object)),
]
IDS = [k for k, _ in KINDS]

# A policy whose chunk for request r >= 2 holds values of KIND_OF[r] (request 1 and the worker's warmup: numbers).
KINDS_POLICY = '''
import numpy as np
import sequence_ai_ros.policy as seq

KIND_OF = {2: 1 + 2j, 3: '1.5', 4: True, 5: None}

@seq.policy(action_space='joint_absolute', action_names=['a', 'b', 'c'], dt=0.02, chunk_length=4,
            observation=seq.ObservationContract(state_names=['a', 'b', 'c']))
class Kinds:
    def infer(self, inp, episode):
        if inp.request_id in KIND_OF:
            return np.full((4, 3), KIND_OF[inp.request_id], dtype=type(KIND_OF[inp.request_id]) if
                           KIND_OF[inp.request_id] is not None else object)
        return np.zeros((4, 3), np.float32)
'''


def _contract() -> Contract:
    return Contract(ActionSpace.JOINT_ABSOLUTE, ('a', 'b', 'c'), 0.02, 4, ObservationContract((), ('a', 'b', 'c')))


# -- the protocol: pack_chunk, the codec, the Observation ------------------------------------------------------

@pytest.mark.parametrize('kind, value', KINDS, ids=IDS)
def test_pack_chunk_refuses_values_that_are_no_real_numbers_naming_actions(kind, value):
    with warnings.catch_warnings():
        warnings.simplefilter('error')            # no ComplexWarning either: refused before any cast
        with pytest.raises(ValueKindViolation, match=rf'actions: {kind} values are refused') as err:
            messages.pack_chunk(value[:, :3], _contract(), request_id=1, episode_id='e', robot_time_s=0.0)
    assert err.value.field == 'actions' and err.value.kind == kind
    assert isinstance(err.value, ContractViolation)     # CONTRACT_VIOLATION on the wire
    chunk = messages.pack_chunk(np.ones((2, 3), np.int64), _contract(), request_id=1, episode_id='e',
                                robot_time_s=0.0)
    assert codec.from_tensor(chunk.actions).dtype == np.float32     # integers are numbers: they pass


@pytest.mark.parametrize('kind, value', KINDS, ids=IDS)
def test_the_codec_and_the_observation_refuse_them_naming_the_field(kind, value):
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        with pytest.raises(ValueKindViolation, match=rf'state: {kind} values') as err:
            codec.to_tensor(value[0], 'float32', what='state')
        assert err.value.field == 'state'
        with pytest.raises(ValueKindViolation, match=rf'state: {kind} values'):
            Observation(state=value[0])
        with pytest.raises(ValueKindViolation, match=r'last_action: '):
            messages.pack_observation(Observation(state=np.zeros(3)), _contract(), episode_id='e', request_id=1,
                                      last_action=value[0])
        if kind != 'bool':                          # bool is a wire dtype of its own; converted, it is refused
            with pytest.raises(ValueKindViolation, match='cannot go on the wire'):
                codec.to_tensor(value[0], what='state')
    assert codec.to_tensor(np.ones(3, bool)).dtype == 'bool'


# -- a real worker: the policy's chunk -------------------------------------------------------------------------

@pytest.fixture
def kinds_worker(tmp_path):
    path = tmp_path / 'kinds.py'
    path.write_text(KINDS_POLICY)
    server = serve_policy_file(path, 'kinds', host='127.0.0.1', port=0)
    yield server
    server.stop(grace=0.5)


def test_a_policy_chunk_of_complex_string_bool_or_object_values_is_refused_to_the_robot_naming_actions(kinds_worker):
    with channel(kinds_worker.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        handshake(stub, 'kinds')
        assert wait_ready(stub, 'kinds').ready
        s = Stream(stub, 'kinds', 'ep')
        assert s.start().HasField('started')
        assert s.ask(state_request(1, np.zeros(3), 'abc')).HasField('chunk')
        for rid, kind in zip(range(2, 6), IDS, strict=True):
            reply = s.ask(state_request(rid, np.zeros(3), 'abc'))
            assert reply.HasField('error'), reply
            assert reply.error.code == pb.CONTRACT_VIOLATION and reply.error.request_id == rid
            assert f'actions: {kind} values are refused' in reply.error.message, reply.error.message
        s.close()


# -- both adapters ---------------------------------------------------------------------------------------------

START = {'shoulder.pos': 1.0, 'elbow.pos': 2.0, 'grip.pos': 3.0}


class Robot:
    """A LeRobot robot's two methods and two feature dicts; ``values`` override its observation."""

    def __init__(self, **values) -> None:
        self.values = values
        self.sent: list[dict] = []

    observation_features = property(lambda self: {**dict.fromkeys(START, float), 'front': (48, 64, 3)})
    action_features = property(lambda self: dict.fromkeys(START, float))

    def get_observation(self) -> dict:
        return {**START, **self.values, 'front': np.zeros((48, 64, 3), np.uint8)}

    def send_action(self, action: dict) -> dict:
        self.sent.append(action)
        return action


@pytest.fixture
def arm_worker():
    yield from serving(POLICIES / 'adapter_arm.py', 'arm')


SCALARS = [('complex', 1 + 2j), ('complex', np.complex64(1.5 + 0.5j)), ('string', '1.5'), ('string', np.str_('2')),
           ('bool', True), ('bool', np.bool_(False)), ('object', None), ('object', object())]


def test_the_lerobot_adapter_refuses_them_naming_the_key_and_sends_nothing(arm_worker):
    endpoint = arm_worker()
    with sequence_ai.connect(model='arm', endpoint=endpoint) as policy:
        for kind, value in SCALARS:
            robot = Robot(**{'elbow.pos': value})
            bot = LeRobotRobot(robot, policy.contract)
            with warnings.catch_warnings():
                warnings.simplefilter('error')
                with pytest.raises(ValueKindViolation, match=rf"'elbow\.pos' is .*not a number: {kind} values") as e:
                    bot.observe()
            assert e.value.field == 'elbow.pos' and e.value.kind == kind
            for _, bad in KINDS:
                with pytest.raises(ValueKindViolation, match='action: ') as e:
                    bot.act(Action(values=bad[0], action_space=ActionSpace.JOINT_ABSOLUTE))
                assert e.value.field == 'action'
            assert robot.sent == []
        # and through a run: the episode ends, the arm never moved
        robot = Robot(**{'elbow.pos': 1 + 2j})
        bot = LeRobotRobot(robot, policy.contract)
        with pytest.raises(ValueKindViolation, match=r"'elbow\.pos'"):
            policy.run(bot.observe, bot.act, max_seconds=30.0, on_underrun=bot.hold)
    assert robot.sent == []
    assert LeRobotRobot(Robot(**{'elbow.pos': np.int16(4)}), _adapter_contract()).observe().state[1] == 4.0


def _adapter_contract() -> Contract:
    from sequence_ai_ros.protocol.contract import CameraSpec

    names = ('shoulder', 'elbow', 'grip')
    return Contract(ActionSpace.JOINT_ABSOLUTE, names, 0.02, 10,
                    ObservationContract((CameraSpec('front', 64, 48),), names))


@pytest.mark.parametrize('kind, value', KINDS, ids=IDS)
def test_the_openpi_adapter_refuses_a_state_of_them_naming_its_key(arm_worker, kind, value):
    pytest.importorskip('openpi_client', reason='openpi-client is installed by make test')
    from sequence_ai_ros.adapters.openpi_policy import SequencePolicy

    frame = np.zeros((48, 64, 3), np.uint8)
    with sequence_ai.connect(model='arm', endpoint=arm_worker()) as served:
        policy = SequencePolicy(served, control_period=0.02, first_chunk_timeout=5.0)
        with warnings.catch_warnings():
            warnings.simplefilter('error')
            with pytest.raises(ValueKindViolation, match=rf"'state' is not a vector of numbers: {kind} values") as e:
                policy.infer({'state': value[0], 'images': {'front': frame}, 'prompt': 'hold'})
        assert e.value.field == 'state'
        good = policy.infer({'state': np.array([1, 2, 3]), 'images': {'front': frame}, 'prompt': 'hold'})
        assert good['actions'].tolist() == [1.0, 2.0, 3.0]      # nothing was opened by the refusal
        policy.reset()


# -- counters and unary bodies ---------------------------------------------------------------------------------

@pytest.fixture
def fast_worker():
    server = serve_policy_file(POLICIES / 'fast.py', 'fast', dim=3, host='127.0.0.1', port=0, metrics_port=0)
    yield server
    server.stop(grace=0.5)


def _scrape(port: int) -> dict:
    text = urllib.request.urlopen(f'http://127.0.0.1:{port}/metrics', timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in prom_parser.text_string_to_metric_families(text) for s in fam.samples}


def test_an_end_reporting_2_32_underruns_is_refused_naming_it_and_moves_no_counter(fast_worker):
    """Attack: EpisodeEnd.underruns = 2**32-1 added 4.29e9 to seq_client_underruns_total."""
    key = ('seq_client_underruns_total', (('deployment', 'fast'),))
    with channel(fast_worker.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        handshake(stub, 'fast')
        assert wait_ready(stub, 'fast').ready
        for eid, end in (('honest', pb.EpisodeEnd(reason='completed', actions=90, chunks=3, underruns=2)),
                         ('liar', pb.EpisodeEnd(reason='completed', actions=2 ** 32 - 1, chunks=2 ** 32 - 1,
                                                underruns=2 ** 32 - 1))):
            s = Stream(stub, 'fast', eid)
            assert s.start().HasField('started')
            s.send(end=end)
            replies = []
            while not (replies and replies[-1].HasField('ended')):
                reply = s.recv(timeout=30)
                assert reply is not None
                replies.append(reply)
            s.close()
            errors = [r.error for r in replies if r.HasField('error')]
            if eid == 'honest':
                assert errors == []
            else:
                assert {e.code for e in errors} == {pb.CONTRACT_VIOLATION}
                named = {e.message.split(':')[0] for e in errors}
                assert named == {'actions', 'chunks', 'underruns'}, errors
                assert all(f'{limits.MAX_END_COUNT:g}' in e.message for e in errors)
        samples = _scrape(fast_worker.metrics_port)
    assert samples[key] == 2                          # the honest episode's, and nothing of the liar's
    assert samples[('seq_boundary_refused_total', (('deployment', 'fast'), ('field', 'underruns')))] == 1


@pytest.mark.parametrize('method, message', [('Handshake', 'HandshakeRequest'), ('Ready', 'ReadyRequest'),
                                             ('Label', 'LabelRequest')])
def test_an_undecodable_unary_request_gets_invalid_argument_naming_the_message(fast_worker, method, message):
    """Attack: an undecodable unary request got UNKNOWN instead of a typed error."""
    with channel(fast_worker.port) as ch:
        call = ch.unary_unary(f'/sequence_ai.v1.PolicyService/{method}', request_serializer=lambda b: b,
                              response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as err:
            call(b'\xff\xff\xff\xff garbage', metadata=[('x-deployment', 'fast')], timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert err.value.details().startswith('[CONTRACT_VIOLATION]') and message in err.value.details()
        stub = pb_grpc.PolicyServiceStub(ch)             # the worker answers the next call as ever
        assert handshake(stub, 'fast').action_names
