"""Capture settings of one deployment (``settings.json``) and the per-episode sampling decision.

``seq policy capture NAME --rate R --images --retention-days D --fps F`` writes the settings; the worker's
:class:`~sequence_ai_ros.capture.store.CaptureStore` re-reads them at each episode start, so a change takes
effect at the next episode without a restart.

Sampling is decided once per episode, from its id alone, so it is reproducible: the first 8 bytes of
``sha256(episode_id)`` read as an unsigned big-endian integer over 2**64 give a number u in [0, 1),
and the episode is kept when ``u < rate``. Rate 1.0 keeps every episode, rate 0 none.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from sequence_ai_ros.exceptions import ConfigError

SETTINGS_FILE = 'settings.json'
#: Telemetry rate used when none is configured (Hz); at or below 30 Hz as the field-data issue asks.
DEFAULT_FPS = 15.0
#: Days a captured episode is kept.
DEFAULT_RETENTION_DAYS = 30.0
MAX_FPS = 60.0
#: The highest row rate taken from a policy's dt (a 100 Hz policy exports at 100 fps).
MAX_POLICY_FPS = 1000.0


@dataclasses.dataclass(frozen=True)
class CaptureSettings:
    """What a deployment keeps.

    :param rate: share of episodes kept, in [0, 1].
    :param images: keep camera frames (observation images and telemetry frames); off: no pixels stored.
    :param retention_days: captured episodes older than this (days, by their end time) are deleted.
    :param fps: the row rate of captured episodes (Hz), a whole number in 1..60, or None (the default)
        for the policy's action rate ``round(1 / dt)``; it becomes the fps of a LeRobot export and the
        rate of the camera frames the robot streams (state and commands come at every control tick).
    :param enabled: False after ``--off``: no new episode is captured; what was kept stays.
    :param quota_bytes: the most bytes the store may hold (None = no quota); reaching it pauses capture.
    :raises ConfigError: for a value out of range.
    """

    rate: float = 0.0
    images: bool = False
    retention_days: float = DEFAULT_RETENTION_DAYS
    fps: float | None = None
    enabled: bool = False
    quota_bytes: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.rate, (int, float)) and 0.0 <= float(self.rate) <= 1.0):
            raise ConfigError(f'capture rate must be in [0, 1], got {self.rate!r}')
        if not (isinstance(self.retention_days, (int, float)) and math.isfinite(self.retention_days)
                and self.retention_days > 0):
            raise ConfigError(f'retention_days must be > 0, got {self.retention_days!r}')
        fps = self.fps
        if fps is not None and not (isinstance(fps, (int, float)) and math.isfinite(fps) and 1 <= fps <= MAX_FPS
                and float(fps).is_integer()):
            raise ConfigError(f'capture fps must be a whole number of Hz in 1..{MAX_FPS:g} '
                              f'(LeRobot datasets have an integer fps), got {fps!r}')
        if self.quota_bytes is not None and (not isinstance(self.quota_bytes, int) or self.quota_bytes < 0):
            raise ConfigError(f'quota_bytes must be a non-negative integer or null, got {self.quota_bytes!r}')
        object.__setattr__(self, 'rate', float(self.rate))
        object.__setattr__(self, 'fps', None if self.fps is None else float(self.fps))
        object.__setattr__(self, 'retention_days', float(self.retention_days))

    @property
    def active(self) -> bool:
        """True when new episodes may be captured (enabled with a rate above 0)."""
        return self.enabled and self.rate > 0.0

    def row_fps(self, dt: float | None) -> float:
        """Return the row rate (Hz): ``fps`` when set, else the policy's ``round(1 / dt)`` within 1..1000.

        When 1/dt is not a whole number (e.g. dt = 0.15 s, 6.67 Hz) the rows come at the nearest whole
        rate (7 Hz) and the ticks are mapped to rows by time (see :mod:`sequence_ai_ros.datasets.rows`).
        """
        if self.fps is not None:
            return float(self.fps)
        if not dt or not math.isfinite(dt) or dt <= 0:
            return float(DEFAULT_FPS)
        return float(min(MAX_POLICY_FPS, max(1.0, round(1.0 / dt))))

    def keeps(self, episode_id: str) -> bool:
        """Return True when this episode is sampled (see the module docstring; ignores ``enabled``)."""
        return sample_value(episode_id) < self.rate

    def to_json(self) -> dict[str, Any]:
        """Return the settings as a JSON-ready dict (the content of ``settings.json``)."""
        return dataclasses.asdict(self)


def sample_value(episode_id: str) -> float:
    """Return the episode's sampling number in [0, 1): ``sha256(id)[:8]`` big-endian over 2**64."""
    digest = hashlib.sha256(episode_id.encode('utf-8')).digest()
    return int.from_bytes(digest[:8], 'big') / 2.0 ** 64


def load_settings(root: str | Path) -> CaptureSettings:
    """Read ``root/settings.json``; a missing file means capture off (the defaults).

    :raises ConfigError: when the file is not valid JSON or holds an invalid or unknown value.
    """
    path = Path(root) / SETTINGS_FILE
    try:
        raw = json.loads(path.read_text(encoding='utf-8'))
    except FileNotFoundError:
        return CaptureSettings()
    except (OSError, ValueError) as exc:
        raise ConfigError(f'capture settings {path} unreadable: {exc}') from None
    if not isinstance(raw, dict):
        raise ConfigError(f'capture settings {path}: a JSON object is required')
    known = {f.name for f in dataclasses.fields(CaptureSettings)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f'capture settings {path}: unknown keys {unknown} (known: {sorted(known)})')
    return CaptureSettings(**raw)


def save_settings(root: str | Path, settings: CaptureSettings) -> Path:
    """Write ``root/settings.json`` atomically (temp file, fsync, rename); return its path."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    path = root / SETTINGS_FILE
    fd, tmp = tempfile.mkstemp(prefix='.settings.', dir=root)
    try:
        with os.fdopen(fd, 'w', encoding='utf-8') as f:
            json.dump(settings.to_json(), f, indent=2)
            f.write('\n')
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
