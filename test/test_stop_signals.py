"""SIGINT/SIGTERM handling that cannot deadlock (``sequence_ai_ros.stop_signals``), in a real child process.

A break-it review hung bag_player with a burst of SIGINTs: its handler set an Event while the main thread
held that Event's lock (``on_signal -> Event.set -> notify_all -> on_signal -> Event.set``). The child here
spends its time in exactly those locks (Event.wait and Event.set in a tight loop) while it is signalled.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

CHILD = r'''
import sys, threading, time
from sequence_ai_ros.stop_signals import on_stop_signals
stop = threading.Event()
busy = threading.Event()
calls = []
on_stop_signals(lambda: (calls.append(1), stop.set()))
print('ready', flush=True)
while not stop.is_set():
    busy.set()                    # the main thread inside Event locks all the time
    busy.wait(0.0005)
    busy.clear()
time.sleep(0.2)                   # later signals must not run the callback again
print('stopped', len(calls), flush=True)
'''


def test_a_burst_of_signals_stops_once_and_never_hangs():
    for sig in (signal.SIGINT, signal.SIGTERM):
        proc = subprocess.Popen([sys.executable, '-c', CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env={**os.environ, 'PYTHONPATH': str(Path(__file__).resolve().parents[1])})
        try:
            assert proc.stdout.readline().strip() == 'ready'
            for _ in range(200):
                proc.send_signal(sig)
                time.sleep(0.0002)
            out, err = proc.communicate(timeout=20)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, err[-2000:]
        assert out.strip() == 'stopped 1', (out, err[-500:])
