"""The control timeline on the wire: what one tick's record says about its place and why it held.

Each control tick makes one record (:class:`sequence_ai_ros.client.steps.Step`), streamed as a
``TelemetryFrame`` when the episode is captured. Its place on the episode's timeline:

- ``grid_index``: the control deadline it served, counted from the episode's first deadline (0);
- ``[step_start, step_end)``: the chunk steps it covers on the episode's chunk-step axis, the control grid
  in units of the policy's dt (0 at the first deadline; a 50 Hz tick against dt = 1/30 s covers 0.6).

Deadlines no tick served leave a gap between one record's end and the next one's start.
"""

from __future__ import annotations

# The limits of these fields (HOLD_REASONS, MAX_STEP, MAX_GRID_INDEX) are defined once, with every other
# value from the wire, in :mod:`sequence_ai_ros.protocol.limits`.
from sequence_ai_ros.protocol.limits import HOLD_REASONS, MAX_GRID_INDEX, MAX_STEP

__all__ = ['HOLD_REASONS', 'MAX_GRID_INDEX', 'MAX_STEP']
