"""``python -m sequence_ai_ros.cli``: the ``seq`` command without the console script."""

import sys

from sequence_ai_ros.cli import main

sys.exit(main())
