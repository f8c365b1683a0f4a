"""The control timeline on the wire: what one tick's record says about its place and why it held.

Each control tick makes one record (:class:`sequence_ai_ros.client.steps.Step`), streamed as a
``TelemetryFrame`` when the episode is captured. Its place on the episode's timeline:

- ``grid_index``: the control deadline it served, counted from the episode's first deadline (0);
- ``[step_start, step_end)``: the chunk steps it covers on the episode's chunk-step axis, the control grid
  in units of the policy's dt (0 at the first deadline; a 50 Hz tick against dt = 1/30 s covers 0.6).

Deadlines no tick served leave a gap between one record's end and the next one's start.
"""

from __future__ import annotations

#: Why a tick held instead of executing a fresh policy action ('' when it executed one):
#: ``waiting`` (no chunk yet, or the observation history is filling), ``underrun`` (the chunk buffer ran
#: dry), ``refused`` (the robot's own check refused the command: safety, an invalid observation),
#: ``dry_run`` (the command went to a dry-run topic, not the controller), ``ended`` (the episode had ended).
HOLD_REASONS = ('waiting', 'underrun', 'refused', 'dry_run', 'ended')
#: Largest chunk-step position a record may carry (a decade at 1 kHz control against a 1 ms dt).
MAX_STEP = 1e12
#: Largest grid index a record may carry (within a float64's exact integers).
MAX_GRID_INDEX = 2 ** 53
