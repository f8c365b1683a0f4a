"""What :meth:`Policy.interrupt` stops: the episode the handle runs, or the one it is about to open.

A stop is pressed from any thread (a stop button, a signal handler, a ROS service) at any moment, also
while nothing runs yet: act()/run() waiting for a deployment to warm, wait_until_ready() before a
next_action() loop, a call that is opening its episode. :class:`Stop` decides what a press stops, under one
lock shared with the publication of every episode the handle opens, so no press falls between "nothing runs
yet" and "the episode runs":

- an episode that runs ends at once, with reason ``interrupted``;
- while a call that opens an episode is under way (act()/run() from the call until it returns, their
  warming wait included; begin_episode(); next_action()) or wait_until_ready() waits, the press is *kept*:
  the next episode the handle opens takes it and ends as it opens (act()/run() return ``interrupted``
  with 0 actions; next_action() returns that episode's hold);
- at any other time (no episode runs, no call is under way) a press does nothing and nothing is kept, so
  it never stops an episode started later.

A kept press is used by the next episode opened; it is dropped by end_episode(), and when the last call
under way ends without opening one, except a wait_until_ready() that returned ready: that one hands it on
to the episode the loop opens next.

Threads: any thread presses; the handle's control thread opens episodes and makes calls. No lock is held
across I/O or a caller's code.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol


class Stoppable(Protocol):
    """An episode a stop can end (the client's :class:`~sequence_ai_ros.client.engine.EpisodeEngine`)."""

    def outcome(self) -> object | None:
        """None while it runs."""
        ...

    def finish(self, reason: str) -> object:
        """End it with ``reason`` (a second finish keeps the first reason)."""
        ...


class Stop:
    """One handle's stop: presses, the calls under way, the episode that runs; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: Stoppable | None = None
        self._calls = 0
        self._kept = False
        #: set while a press is kept: a wait that the stop should cut short (act()/run() waiting for the
        #: deployment to warm) waits on it
        self.kept_event = threading.Event()

    @property
    def kept(self) -> bool:
        """True while a press waits for the episode the handle opens next."""
        return self._kept

    def press(self) -> None:
        """Stop the running episode, or keep the stop for the episode a call under way opens; else nothing."""
        with self._lock:
            running = self._running
            if running is None or running.outcome() is not None:
                if self._calls:
                    self._keep(True)
                return
        running.finish('interrupted')

    def opened(self, episode: Stoppable) -> bool:
        """Publish ``episode`` as the one that runs; a kept press ends it now. Return True when one did."""
        with self._lock:
            self._running = episode
            kept = self._kept
            self._keep(False)
        if kept:
            episode.finish('interrupted')
        return kept

    def drop(self) -> None:
        """Forget a kept press (end_episode())."""
        with self._lock:
            self._keep(False)

    @contextmanager
    def call(self, *, hand_on: bool = False) -> Iterator[None]:
        """A call under way that opens an episode, or prepares one; a press meanwhile is kept for it.

        :param hand_on: wait_until_ready(): when it returns (not when it raises), a kept press stays for the
            episode opened after it; otherwise the last call under way to end drops it.
        """
        with self._lock:
            self._calls += 1
        returned = False
        try:
            yield
            returned = True
        finally:
            with self._lock:
                self._calls -= 1
                if not self._calls and not (hand_on and returned):
                    self._keep(False)

    def _keep(self, kept: bool) -> None:
        self._kept = kept
        if kept:
            self.kept_event.set()
        else:
            self.kept_event.clear()
