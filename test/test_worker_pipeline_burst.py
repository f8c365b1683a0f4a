"""A burst of inferences pipelined to a real deployment process, each on a new shared-memory segment.

The calls started behind the first carry one ``memfd`` each (``SCM_RIGHTS``) and reach the process back to back,
several in one read; the process must take every fd (a read with room for 4 lost the rest, and each later call
answered ``IndexError: pop from an empty deque`` or read another call's segment). Every answer is checked against
its own input's values, with a call cancelled in the middle and a thread's call after the burst, so a segment mixed
up shows as a wrong value.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import textwrap
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from sequence_ai_ros.worker import policy_host as wire
from sequence_ai_ros.worker import policy_process
from sequence_ai_ros.worker.policy_process import describe_policy_file

SUM = textwrap.dedent('''
    import numpy as np
    import sequence_ai_ros.policy as seq

    @seq.policy(action_space='joint_absolute', action_names=['a', 'b'], dt=0.1, chunk_length=2,
                observation=seq.ObservationContract(state_names=['a', 'b']))
    class Sum:
        """Answers (sum, size) of the array it is given."""

        def infer(self, inp, episode):
            return np.array([[float(inp.sum()), float(inp.size)]] * 2)
''')


@pytest.fixture
def policy(tmp_path):
    path = tmp_path / 'sum.py'
    path.write_text(SUM)
    remote = describe_policy_file(path, 'sum', 60).instantiate()
    try:
        remote.load()
        yield remote
    finally:
        remote.close()


def _burst(policy, loop, rounds: int, cancel_at: int) -> list[tuple[str, object, np.ndarray]]:
    """``rounds`` bursts of PIPELINE_DEPTH calls started in one pass of the loop, each larger than the last."""
    async def run() -> list[tuple[str, object, np.ndarray]]:
        out = []
        size = 1 << 20
        for r in range(rounds):
            started = []
            for k in range(wire.PIPELINE_DEPTH):
                size += 8192                                # never fits a free segment: a new one (and fd) each
                arr = np.full(size, (r * 31 + k) % 251 + 1, np.uint8)
                fut = loop.create_future()
                cancel = policy.process.start(loop, lambda s, v, f=fut: f.set_result((s, v)), 'infer', arr,
                                              ('e', '', 'sum'), step='inferring')
                assert cancel is not None, k
                if k == cancel_at:
                    cancel()
                started.append((fut, arr))
            for fut, arr in started:
                status, value = await asyncio.wait_for(fut, 60)
                out.append((status, value, arr))
        return out

    return loop.run_until_complete(run())


def test_a_burst_of_pipelined_calls_each_with_a_new_segment_gets_its_own_answers(policy, monkeypatch):
    monkeypatch.setattr(policy_process, 'PIPELINED_ARRAY_BYTES', 1 << 30)    # a whole burst in flight (~85 MB)
    loop = asyncio.new_event_loop()
    try:
        answers = _burst(policy, loop, rounds=2, cancel_at=7)
    finally:
        loop.close()
    assert len(answers) == 2 * wire.PIPELINE_DEPTH
    for k, (status, value, arr) in enumerate(answers):
        if status == 'dropped':                             # the cancelled one, if its turn had not come
            assert k % wire.PIPELINE_DEPTH == 7 and value is None
            continue
        assert status == 'ok', (k, status, value)
        assert (value[0][0], value[0][1]) == (float(arr.astype(np.int64).sum()), float(arr.size)), k
    arr = np.arange(1000, dtype=np.float32)                 # a thread's call after the bursts: its own segment too
    assert policy.process.call('infer', arr, ('t', '', 'sum'))[0][0] == float(arr.sum())
    assert policy.alive()


def test_calls_in_flight_hold_at_most_the_array_bytes_bound_and_the_rest_wait(policy, monkeypatch):
    """Past PIPELINED_ARRAY_BYTES of arrays in flight a call is not sent: it waits in the deployment's queue.

    start() answers None for it; the first call is always sent, and once answers come calls are sent again.
    """
    monkeypatch.setattr(policy_process, 'PIPELINED_ARRAY_BYTES', 3 << 20)
    loop = asyncio.new_event_loop()
    arrays = [np.full(1 << 20, k + 1, np.uint8) for k in range(4)]      # 1 MB each

    async def run() -> tuple[list[bool], list[tuple[str, object]], bool]:
        futures, sent = [], []
        for arr in arrays:
            fut = loop.create_future()
            cancel = policy.process.start(loop, lambda s, v, f=fut: f.set_result((s, v)), 'infer', arr,
                                          ('e', '', 'sum'), step='inferring')
            sent.append(cancel is not None)
            if cancel is not None:
                futures.append(fut)
        answers = [await asyncio.wait_for(fut, 60) for fut in futures]
        fut = loop.create_future()       # nothing in flight now: a 4 MB call alone goes at once
        again = policy.process.start(loop, lambda s, v: fut.set_result((s, v)), 'infer',
                                     np.ones(4 << 20, np.uint8), ('e', '', 'sum'), step='inferring')
        answers.append(await asyncio.wait_for(fut, 60))
        return sent, answers, again is not None

    try:
        sent, answers, again = loop.run_until_complete(run())
    finally:
        loop.close()
    assert sent == [True, True, True, False], sent                  # 3 MB in flight: the fourth waits
    assert again
    for (status, value), arr in zip(answers, [*arrays[:3], np.ones(4 << 20, np.uint8)], strict=True):
        assert status == 'ok' and value[0][0] == float(arr.astype(np.int64).sum()), (status, value)


def _loop_call(policy, loop, arr: np.ndarray) -> tuple[str, object]:
    """One call started from ``loop`` (running it until the answer)."""
    return loop.run_until_complete(_answer(policy, loop, arr))


def test_loop_calls_and_thread_calls_alternate_each_with_its_own_answer_while_the_loop_keeps_its_reader(policy):
    """The loop's reader stays registered between its calls; a thread's call meanwhile reads its own answer.

    The thread's call runs while the loop runs, so its answer wakes the loop's reader with nothing in flight: the
    reader goes then, and the loop's next call registers it again.
    """
    loop = asyncio.new_event_loop()
    arrays = [np.full(1000 + k, k + 1, np.uint8) for k in range(6)]
    try:
        got = []
        for k, arr in enumerate(arrays):
            if k % 2:      # a thread's call, while the loop runs (and watches the socket)
                got.append(('ok', loop.run_until_complete(asyncio.wait_for(loop.run_in_executor(
                    None, policy.process.call, 'infer', arr, ('t', '', 'sum')), 60))))
            else:
                got.append(_loop_call(policy, loop, arr))
    finally:
        loop.close()
    for (status, value), arr in zip(got, arrays, strict=True):
        assert status == 'ok' and (value[0][0], value[0][1]) == (float(arr.astype(np.int64).sum()), arr.size)
    assert policy.alive()


def test_a_closed_deployment_process_leaves_no_reader_on_its_loop_for_a_reused_fd_number(policy):
    """Closing the process removes the loop's reader of its socket.

    A socket given that fd number later is the loop's to watch, and its reader (not the old one) runs.
    """
    loop = asyncio.new_event_loop()
    try:
        assert _loop_call(policy, loop, np.ones(100, np.uint8))[0] == 'ok'
        fd = policy.process._sock.fileno()
        policy.close()                                    # from this thread, the loop not running
        with _socket_numbered(fd) as peer:
            seen = loop.create_future()
            loop.add_reader(fd, lambda: seen.done() or seen.set_result(os.read(fd, 10)))
            peer.send(b'new')
            assert loop.run_until_complete(asyncio.wait_for(seen, 10)) == b'new'
            loop.remove_reader(fd)
    finally:
        loop.close()


@contextlib.contextmanager
def _socket_numbered(fd: int) -> Iterator[socket.socket]:
    """A socket pair's end given the (free) number ``fd``; yields the other end, to write to it."""
    a, b = socket.socketpair()                        # the lowest free numbers: maybe ``fd`` already
    try:
        if fd not in (a.fileno(), b.fileno()):
            os.dup2(a.fileno(), fd)
        yield a if b.fileno() == fd else b
    finally:
        if fd not in (a.fileno(), b.fileno()):
            os.close(fd)
        a.close()
        b.close()


def test_a_close_that_cannot_wait_for_a_stalled_loop_still_leaves_no_reader_for_a_reused_fd_number(policy):
    """The loop (a thread of its own) is stalled past close()'s wait: the socket closes behind the reader's removal."""
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, name='test-loop', daemon=True)
    runner.start()
    try:
        asked = asyncio.run_coroutine_threadsafe(_answer(policy, loop, np.ones(10, np.uint8)), loop)
        assert asked.result(30)[0] == 'ok'
        fd = policy.process._sock.fileno()
        stalled = threading.Event()
        loop.call_soon_threadsafe(lambda: stalled.set() or time.sleep(2.5))       # past close()'s 2 s wait
        assert stalled.wait(10)
        policy.close()
        deadline = time.monotonic() + 15           # the loop closes the socket once it ran on
        while policy.process._sock.fileno() >= 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        with _socket_numbered(fd) as peer:
            seen = threading.Event()

            def read() -> None:
                os.read(fd, 10)
                loop.remove_reader(fd)
                seen.set()

            loop.call_soon_threadsafe(loop.add_reader, fd, read)
            peer.send(b'new')
            assert seen.wait(15)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(10)
        loop.close()


def test_a_second_loop_starts_calls_once_the_first_has_stopped(policy):
    first, second = asyncio.new_event_loop(), asyncio.new_event_loop()
    try:
        assert _loop_call(policy, first, np.ones(10, np.uint8))[0] == 'ok'       # first stops, still open
        assert _loop_call(policy, second, np.full(10, 2, np.uint8))[1][0][0] == 20.0
    finally:
        first.close()
        second.close()


async def _answer(policy, loop, arr: np.ndarray) -> tuple[str, object]:
    fut = loop.create_future()
    assert policy.process.start(loop, lambda s, v: fut.set_result((s, v)), 'infer', arr, ('e', '', 'sum'),
                                step='inferring') is not None
    return await asyncio.wait_for(fut, 60)


class _Unloadable:
    """Pickles in the worker; unpickling it in the deployment process raises (``int('not a number')``)."""

    def __reduce__(self) -> tuple[type, tuple[str]]:
        return int, ('not a number',)


def _mapped_segments(pid: int, name: str = 'sum') -> set[str]:
    """The worker's shared-memory segments the process ``pid`` maps (``memfd:seq-<name>-<id>``)."""
    with open(f'/proc/{pid}/maps', encoding='utf-8') as maps:
        return {line.split()[-2] for line in maps if f'memfd:seq-{name}-' in line}


def test_a_call_the_process_cannot_unpickle_fails_typed_and_frees_its_segment(policy):
    """Its segment is free again at once: the next calls reuse it, so the process maps one segment, not one each."""
    process = policy.process
    arr = np.full(1 << 20, 3, np.uint8)
    for _ in range(5):
        with pytest.raises(policy_process.RemoteError, match='not a number'):
            process.call('infer', [arr, _Unloadable()], ('e', '', 'sum'), step='inferring')
    value = process.call('infer', arr, ('e', '', 'sum'), step='inferring')
    assert value[0][0] == float(arr.astype(np.int64).sum())
    assert len(_mapped_segments(process.pid)) == 1


LIMITED = textwrap.dedent('''
    import resource
    import numpy as np
    import sequence_ai_ros.policy as seq

    @seq.policy(action_space='joint_absolute', action_names=['a', 'b'], dt=0.1, chunk_length=2,
                observation=seq.ObservationContract(state_names=['a', 'b']))
    class Limited:
        """Answers (sum, size), as Sum; its load caps the process's address space at 48 MB above its use."""

        def load(self):
            with open('/proc/self/status') as f:
                vm = next(int(line.split()[1]) for line in f if line.startswith('VmSize:')) * 1024
            resource.setrlimit(resource.RLIMIT_AS, (vm + (48 << 20), resource.RLIM_INFINITY))

        def infer(self, inp, episode):
            return np.array([[float(inp.sum()), float(inp.size)]] * 2)
''')


def test_a_new_segment_the_process_cannot_map_fails_its_call_alone(tmp_path):
    """A call's new segment the process cannot map (ENOMEM) fails that call alone, typed.

    The segment is dropped on both sides: reused as free, each later call failed with ``KeyError``; kept as held,
    each call of that size leaked a new one.
    """
    path = tmp_path / 'limited.py'
    path.write_text(LIMITED)
    remote = describe_policy_file(path, 'limited', 60).instantiate()
    try:
        remote.load()
        process = remote.process
        for _ in range(3):
            with pytest.raises(policy_process.RemoteError):
                process.call('infer', np.full(96 << 20, 1, np.uint8), ('e', '', 'limited'))
        for k in range(3):
            arr = np.full(1 << 20, k + 2, np.uint8)
            value = process.call('infer', arr, ('e', '', 'limited'))
            assert value[0][0] == float(arr.astype(np.int64).sum())
        assert len(_mapped_segments(process.pid, 'limited')) == 1
    finally:
        remote.close()


def test_a_read_that_loses_file_descriptors_fails_the_channel_not_a_later_call():
    ours, theirs = socket.socketpair()
    pipes = [os.pipe() for _ in range(wire.FDS_PER_READ + 1)]
    channel = wire.Channel(ours)
    try:
        wire.Channel(theirs).send([b'x'], [r for r, _ in pipes], seq=1)     # one fd more than a read has room for
        with pytest.raises(wire.ProtocolError, match='file descriptors were lost'):
            channel.recv(1)
    finally:
        for fd in channel.fds:                              # those the read had room for
            os.close(fd)
        ours.close()
        theirs.close()
        for fds in pipes:
            for fd in fds:
                os.close(fd)


GATED = textwrap.dedent('''
    import os, time
    import numpy as np
    import sequence_ai_ros.policy as seq

    @seq.policy(action_space='joint_absolute', action_names=['a', 'b'], dt=0.1, chunk_length=4,
                observation=seq.ObservationContract(state_names=['a', 'b']))
    class Gated:
        def infer(self, inp, episode):
            gate = inp.observation.params.get('gate')
            deadline = time.monotonic() + 60
            while gate and not os.path.exists(gate) and time.monotonic() < deadline:
                time.sleep(0.005)
            episode.state['n'] = episode.state.get('n', 0) + 1
            return np.tile(np.array([inp.observation.state[0], episode.state['n']], np.float32), (4, 1))
''')


def test_a_worker_answers_each_robot_of_a_burst_behind_a_busy_deployment_process_with_its_own_chunk(tmp_path):
    """A real worker: PIPELINE_DEPTH robots' requests sent at once behind a held one (a new segment each), twice."""
    from test_worker_support import Stream, channel, state_request, wait_for, wait_ready

    from sequence_ai_ros.protocol import codec
    from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
    from sequence_ai_ros.worker import serve_policy_file

    path = tmp_path / 'gated' / 'policy.py'
    path.parent.mkdir()
    path.write_text(GATED)
    server = serve_policy_file(path, deployment='gated', host='127.0.0.1', port=0, isolation='process',
                               inference_timeout_s=120.0, idle_timeout_s=120)
    ch = channel(server.port)
    try:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'gated', timeout=60).ready
        runtime = server.runtimes['gated']
        robots = [Stream(stub, 'gated', f'robot-{k}') for k in range(wire.PIPELINE_DEPTH)]
        for robot in robots:
            assert robot.start().HasField('started')
        for rnd in (1, 2):
            gate = tmp_path / f'gate{rnd}'
            robots[0].send(observation=state_request(rnd, [100.0 * rnd, 0.0], ['a', 'b'], params={'gate': str(gate)}))
            wait_for(lambda: runtime.scheduler.pipelined == 1, 60, 'the first request held at the gate')
            for k, robot in enumerate(robots[1:], 1):          # no wait between them: a burst
                robot.send(observation=state_request(rnd, [100.0 * rnd + k, 0.0], ['a', 'b']))
            wait_for(lambda: runtime.scheduler.pipelined == wire.PIPELINE_DEPTH, 60, 'the burst in flight')
            gate.touch()
            for k, robot in enumerate(robots):
                reply = robot.recv()
                assert reply is not None and reply.HasField('chunk'), (rnd, k, reply)
                assert tuple(codec.from_tensor(reply.chunk.actions)[0]) == (100.0 * rnd + k, rnd), (rnd, k)
        for robot in robots:
            assert robot.end().HasField('ended')
        assert runtime.restarts == 0
    finally:
        ch.close()
        server.stop(grace=0.5)


def test_a_deployment_process_runs_the_workers_copy_of_the_package_not_one_in_the_working_directory(tmp_path,
                                                                                                    monkeypatch):
    """``python -m`` put the working directory first: a checkout there (another version) served the worker's calls."""
    (tmp_path / 'cwd' / 'sequence_ai_ros').mkdir(parents=True)
    (tmp_path / 'cwd' / 'sequence_ai_ros' / '__init__.py').write_text("raise ImportError('the working directory copy')")
    (tmp_path / 'cwd' / 'helper_mod.py').write_text('VALUE = 7\n')            # still importable by a policy
    path = tmp_path / 'sum.py'
    path.write_text(SUM.replace('return np.array([[float(inp.sum())',
                                'import helper_mod\n        return np.array([[float(inp.sum()) + helper_mod.VALUE'))
    monkeypatch.chdir(tmp_path / 'cwd')
    remote = describe_policy_file(path, 'sum', 60).instantiate()
    try:
        remote.load()
        assert remote.process.call('infer', np.ones(3), ('e', '', 'sum'))[0][0] == 3.0 + 7
    finally:
        remote.close()


def test_a_deployment_process_of_another_version_than_its_worker_exits_naming_it(tmp_path, monkeypatch):
    """The package changed on disk since the worker imported it: its process says so, never reads calls as garbage."""
    from sequence_ai_ros.worker.policy_process import PolicyProcess, PolicyProcessDied

    monkeypatch.setattr(wire, 'SOURCE_TAG', '0' * 16)            # as a worker that imported an older file
    process = PolicyProcess('skewed')
    try:
        with pytest.raises(PolicyProcessDied, match="exit code 87: its sequence_ai_ros differs from the worker's"):
            process.call('ping', step='starting')
    finally:
        process.close()
    monkeypatch.undo()
    assert len(wire.SOURCE_TAG) == 16                              # the real one: the processes above all started
