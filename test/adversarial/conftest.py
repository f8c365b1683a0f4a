"""Break-it tests: the helpers of test/ (test_worker_support) are importable from here."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
