"""The break-it suite: each attack of the review, reproduced on a real worker over loopback gRPC."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # test/ helpers (test_worker_support)
