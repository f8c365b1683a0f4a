"""glibc malloc tuning for the wire's large per-request buffers (images: ~150 KB each).

Above glibc's mmap threshold (128 KB until it adapts) every such buffer is mmap'd and munmap'd, and the
kernel zero-fills its pages again on each request; a high trim threshold also stops the heap's top being
handed back and faulted in again. :func:`tune_malloc` raises both once per process (client and worker).

Set ``SEQ_MALLOC_TUNING=0`` to turn it off. Harmless elsewhere: on a C library without ``mallopt``
(musl, macOS, Windows) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

M_TRIM_THRESHOLD = -1          # glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024   # glibc's own ceiling for the dynamic threshold (64-bit)
TRIM_THRESHOLD_BYTES = 64 * 1024 * 1024

_lock = threading.Lock()
_done: bool | None = None


def tune_malloc() -> bool:
    """Apply the tuning once per process; safe to call from anywhere, any number of times.

    :returns: True when glibc accepted both settings; False when turned off (``SEQ_MALLOC_TUNING=0``),
        not glibc, or refused. Never raises.
    """
    global _done
    with _lock:
        if _done is None:
            _done = _apply()
        return _done


def _apply() -> bool:
    if os.environ.get('SEQ_MALLOC_TUNING', '1').strip().lower() in ('0', 'false', 'no', 'off'):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6')
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD,
                                                                                  TRIM_THRESHOLD_BYTES))
