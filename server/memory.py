"""Give freed heap memory back to the operating system between the heavy phases.

Receiving uploads churns through many chunk-sized buffers (gRPC messages, protobuf
copies, bytes objects) on several threads; glibc's allocator keeps what they freed in
its per-thread arenas, so the process's resident size stays at the high-water mark of
that churn. Before the round's own peak (the mean, the new model, its payload) the
coordinator asks glibc to return those free pages (``malloc_trim(0)``), so the peak is
the model's copies, not the model's copies plus the arenas' leftovers. A no-op where
the C library has no ``malloc_trim`` (musl, macOS).
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable


def _find_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim: Callable[[int], int] = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    return trim


_TRIM = _find_trim()


def release_free_heap() -> bool:
    """Return the allocator's free pages to the OS; True when something was released."""
    return bool(_TRIM(0)) if _TRIM is not None else False
