"""How long the client waits before it tries again: exponential backoff with full jitter
(AWS Architecture Blog, "Exponential Backoff And Jitter", 2015)."""

from __future__ import annotations

import random


class Backoff:
    """Exponential backoff with full jitter: sleep U(0, min(max, initial * 2**n))."""

    def __init__(self, initial_s: float, max_s: float, rng: random.Random | None = None) -> None:
        self.initial_s, self.max_s = initial_s, max_s
        self.attempt = 0
        self._rng = rng or random.Random()

    def next_delay(self) -> float:
        cap = min(self.max_s, self.initial_s * (2.0**self.attempt))
        self.attempt += 1
        return self._rng.uniform(0.0, cap)

    def reset(self) -> None:
        self.attempt = 0
