"""The server's allocator settings (server/memory.py): glibc's arenas are capped, and
``FEDLOOM_KEEP_MALLOC`` leaves them alone. Checked by counting the arenas glibc itself
reports (``malloc_info``) after threads allocated, in a fresh interpreter each time."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fedloom.server import memory

pytestmark = pytest.mark.skipif(memory._LIBC is None, reason="needs glibc")

# Threads allocate and free chunk-sized buffers at the same time (as gRPC's do), then
# glibc's own report of its heaps is counted.
_PROBE = r"""
import ctypes, re, sys, tempfile, threading
from fedloom.server.memory import release_free_heap, tune_allocator
print(tune_allocator())
barrier = threading.Barrier(8)
def churn():
    barrier.wait()
    held = [bytearray(64 << 10) for _ in range(64)]
    barrier.wait()
    del held
threads = [threading.Thread(target=churn) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
libc = ctypes.CDLL("libc.so.6")
libc.fopen.restype = ctypes.c_void_p
libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
with tempfile.NamedTemporaryFile(suffix=".xml") as f:
    fp = libc.fopen(f.name.encode(), b"w")
    libc.malloc_info(0, fp)
    libc.fclose(fp)
    print(len(re.findall(r'<heap nr="\d+">', open(f.name).read())))
print(release_free_heap() in (True, False))
"""


def _probe(keep: bool) -> tuple[bool, int]:
    env = {k: v for k, v in os.environ.items() if k != memory.KEEP_MALLOC_ENV}
    if keep:
        env[memory.KEEP_MALLOC_ENV] = "1"
    out = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    assert out[2] == "True"
    return out[0] == "True", int(out[1])


def test_tuned_server_process_uses_at_most_the_capped_arenas() -> None:
    tuned, heaps = _probe(keep=False)
    assert tuned
    assert heaps <= memory.ARENAS


def test_keep_malloc_leaves_glibc_its_per_thread_arenas() -> None:
    tuned, heaps = _probe(keep=True)
    assert not tuned
    assert heaps > memory.ARENAS  # the control: without the cap, threads get arenas
