"""The worker's threads do not grow with open streams, and a burst leaves nothing behind (gRPC asyncio)."""

from __future__ import annotations

import os
import re
import sys

import pytest
from test_worker_support import POLICIES, Stream, channel, state_request, wait_for

from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.worker.server import IO_THREADS

pytestmark = pytest.mark.skipif(not os.path.isdir('/proc/self/task'), reason='counts threads in /proc (Linux)')
STREAMS = 96


def threads(pid: int) -> int:
    return len(os.listdir(f'/proc/{pid}/task'))


def test_open_streams_cost_no_threads_and_a_burst_leaves_none(processes):
    proc = processes.spawn([sys.executable, '-m', 'sequence_ai_ros.cli', 'serve', str(POLICIES / 'fast.py'),
                            '--port', '0', '--warm', '--max-streams-per-client', '0'])
    port = int(re.search(r':(\d+)', proc.stdout.readline()).group(1))
    with channel(port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        warm = Stream(stub, 'fast', 'warm-up')  # every lazily started thread (executor, inference) exists now
        assert warm.start().HasField('started') and warm.ask(state_request(1, [0.0] * 26, [f'j{i}' for i in range(26)]))
        assert warm.end().HasField('ended')
        idle = threads(proc.pid)
        streams = [Stream(stub, 'fast', f'burst-{k}') for k in range(STREAMS)]
        for s in streams:
            assert s.start().HasField('started')
        busy = threads(proc.pid)
        for s in streams:
            assert s.end().HasField('ended')
        wait_for(lambda: threads(proc.pid) <= idle + IO_THREADS, timeout=10, what='threads to settle')
        after = threads(proc.pid)
    # 96 open episode streams: at most the fixed I/O pool more than idle (the threaded server held ~2 each)
    assert busy - idle <= IO_THREADS, (idle, busy)
    assert after - idle <= IO_THREADS, (idle, after)
