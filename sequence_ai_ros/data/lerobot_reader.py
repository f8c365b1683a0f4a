"""Deprecated path: :mod:`sequence_ai_ros.data.lerobot_reader` is now :mod:`sequence_ai_ros.datasets.lerobot_reader`.

Kept so that ``policy.py`` files written by earlier ``seq init`` (and deployments in $SEQ_HOME that hold
them) keep importing. Importing it warns with a FutureWarning (the deprecation category Python shows
to end users by default, so `seq deploy` and `seq serve` print it) and binds this name to the new
module itself, so both paths share one module object and every name in it.
"""

from __future__ import annotations

import importlib
import sys
import warnings

warnings.warn('sequence_ai_ros.data.lerobot_reader moved to sequence_ai_ros.datasets.lerobot_reader; update the import',
              FutureWarning, stacklevel=2)
sys.modules[__name__] = importlib.import_module('sequence_ai_ros.datasets.lerobot_reader')
