"""The client's noise reserve: drawn ahead at low priority, finished by the caller."""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest

from fedloom.privacy import _noise_reserve
from fedloom.privacy._noise_reserve import CHUNK, NoiseReserve


def _assert_skellam(values: np.ndarray, mu: float) -> None:
    """Every chunk holds Sk(mu) draws (variance 2 mu), none left unfilled (a fresh
    allocation reads as zeros; five zero draws of Sk(100) have odds of about 2e-8)."""
    assert np.all(np.abs(values) < 30 * np.sqrt(2 * mu))
    for start in range(0, values.shape[0], CHUNK):
        chunk = values[start:start + CHUNK]
        if chunk.size < 1000:
            assert np.any(chunk != 0)
            continue
        assert abs(float(chunk.mean())) < 6 * np.sqrt(2 * mu / chunk.size)
        assert float(chunk.var()) == pytest.approx(2 * mu, rel=0.05)


def test_take_draws_what_a_starved_background_thread_left(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    # The background thread never gets to draw (a machine busy with other work):
    # take() must not wait for it but draw every chunk itself.
    release = threading.Event()
    monkeypatch.setattr(_noise_reserve, "_lower_this_threads_priority",
                        lambda: release.wait(30.0))
    reserve = NoiseReserve()
    length = 3 * CHUNK + 5
    reserve.refill(100.0, length)
    noise = reserve.take(100.0, length)
    release.set()
    assert noise is not None and noise.shape == (length,) and noise.dtype == np.int64
    _assert_skellam(noise, 100.0)


def test_a_chunk_stuck_on_the_background_thread_is_drawn_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The background thread is stuck in its first chunk (starved at low priority):
    # take() does not wait for it, draws that chunk too, and the late copy is dropped.
    started, release, finished = threading.Event(), threading.Event(), threading.Event()
    real = _noise_reserve.sample_skellam
    late: list[np.ndarray] = []

    def stuck_first(mu: float, size: int, rng: np.random.Generator) -> np.ndarray:
        if threading.current_thread().name == "fedloom-noise" and not started.is_set():
            started.set()
            release.wait(30.0)
            late.append(np.full(size, 10**9, np.int64))  # would show if it were kept
            finished.set()
            return late[-1]
        return real(mu, size, rng)

    monkeypatch.setattr(_noise_reserve, "sample_skellam", stuck_first)
    reserve = NoiseReserve()
    reserve.refill(50.0, 4 * CHUNK)
    assert started.wait(10.0)
    noise = reserve.take(50.0, 4 * CHUNK)  # returns while the background is stuck
    release.set()
    assert noise is not None and noise.shape == (4 * CHUNK,)
    _assert_skellam(noise, 50.0)
    # The background thread (at the lowest priority, so perhaps much later on a busy
    # machine) finishes its stale chunk; the noise taken above never holds it.
    assert finished.wait(30.0)
    assert late and not np.any(noise == 10**9)


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread niceness is Linux's")
def test_the_background_thread_draws_at_the_lowest_priority(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    seen: list[tuple[str, int]] = []
    real = _noise_reserve.sample_skellam
    drew = threading.Event()

    def record(mu: float, size: int, rng: np.random.Generator) -> np.ndarray:
        me = threading.current_thread().name
        seen.append((me, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        if me == "fedloom-noise":
            drew.set()
        return real(mu, size, rng)

    monkeypatch.setattr(_noise_reserve, "sample_skellam", record)
    reserve = NoiseReserve()
    reserve.refill(10.0, 2 * CHUNK)
    assert drew.wait(30.0)  # the lowest priority may be scheduled late on a busy machine
    reserve.take(10.0, 2 * CHUNK)
    background = {nice for name, nice in seen if name == "fedloom-noise"}
    assert background == {_noise_reserve.BACKGROUND_NICE}
    caller = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert all(nice == caller for name, nice in seen if name != "fedloom-noise")
