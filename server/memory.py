"""Keep the server's heap small between and during the heavy phases (glibc only).

Receiving uploads churns through many chunk-sized buffers (gRPC messages, protobuf
copies, bytes objects) on several threads. glibc's allocator, left to itself, gives
each thread its own arena (up to 8 per core) and keeps what each freed, so the
process's resident size stays at the high-water mark of that churn, arena by arena.

- `tune_allocator` (called when a `Server` is made) caps glibc at `ARENAS` arenas, so
  the chunk buffers freed by one gRPC thread are reused by the next instead of piling
  up in arenas of their own. Measured on the transfer benchmark (10M float32
  parameters, 5 clients, 4 runs alternating with the previous code): the server's peak
  above idle fell from 4.14-4.29x the model to 3.56-3.59x, and with 50 clients from
  5.09x to 4.66x; round times stayed within the machine's noise (1.15-1.71 s either
  way). It is a setting of the whole process (the server is meant to be one); set
  ``FEDLOOM_KEEP_MALLOC=1`` to leave the allocator alone.
- `release_free_heap` asks glibc to return free pages (``malloc_trim(0)``) before the
  round's own peak (the mean, the new model, its payload).

Both are no-ops where the C library is not glibc (musl, macOS).
"""

from __future__ import annotations

import ctypes
import os
import sys

#: glibc's ``mallopt`` parameter for the arena limit (``M_ARENA_MAX`` in malloc.h).
M_ARENA_MAX = -8
#: Arenas the server's allocator may use (the main one and one shared by threads).
ARENAS = 2
#: Set (to anything non-empty) to keep glibc's default allocator settings.
KEEP_MALLOC_ENV = "FEDLOOM_KEEP_MALLOC"


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 - glibc has both; musl has neither
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _glibc()


def tune_allocator() -> bool:
    """Cap glibc's arenas (see the module); True when the setting took."""
    if _LIBC is None or os.environ.get(KEEP_MALLOC_ENV):
        return False
    return bool(_LIBC.mallopt(M_ARENA_MAX, ARENAS))


def release_free_heap() -> bool:
    """Return the allocator's free pages to the OS; True when something was released."""
    return bool(_LIBC.malloc_trim(0)) if _LIBC is not None else False
