"""Quarantine: a client that keeps sending refused messages is shut out for a while.

Every refusal of a joined client's message for a reason an honest client does not
cause — malformed or out-of-range content, a task that is not its own, a different
result for a used nonce, an oversize payload, a stream past its time limit or its
minimum rate — is a *strike*. ``quarantine_after`` strikes within ``quarantine_s``
seconds quarantine for ``quarantine_s`` seconds, and Joins are refused with
RESOURCE_EXHAUSTED ("quarantined; retry in N s"). The SDK treats that as a transient
failure and comes back with backoff after the quarantine ends.

What is quarantined depends on what the server knows (`fedloom.server.fleet`): a
proven identity (client certificate, token) is struck and quarantined as itself, and
all its sessions end. A name the client merely chose (``insecure``, ``auth.anonymous``)
proves nothing, so it keys nothing: strikes count against the peer address, the
striking session ends, and Joins from that address are refused while it lasts; the
sessions of other clients, whatever their names, are left alone.

Not strikes: a late result for a closed round (STALE) and an unknown session (after a
server restart) happen to honest clients. Memory is bounded: at most ``max_tracked``
identities are remembered (the stalest are forgotten first), so a flood of made-up
names cannot grow the server.

>>> q = Quarantine(after=2, duration_s=60.0, clock=lambda: 0.0)
>>> q.strike("site-7", RejectReason.INVALID), q.strike("site-7", RejectReason.INVALID)
(False, True)
>>> q.remaining_s("site-7")
60.0
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

from fedloom.errors import MessageRejectedError, RejectReason

#: Refusals that count against a client.
STRIKES = frozenset(
    {
        RejectReason.INVALID,
        RejectReason.FORBIDDEN,
        RejectReason.CONFLICT,
        RejectReason.TOO_LARGE,
        RejectReason.TIMEOUT,
    }
)


class Quarantine:
    """Strike counts and quarantines by client identity. Not thread-safe (event loop).

    Args:
        after: strikes within ``duration_s`` that quarantine an identity (0 disables).
        duration_s: how long a quarantine lasts, and the window strikes are counted in.
        clock: monotonic seconds (tests pass a fake).
        max_tracked: most identities remembered at once.
    """

    def __init__(
        self,
        after: int,
        duration_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_tracked: int = 10_000,
        noun: str = "client",
    ) -> None:
        self.noun = noun  # what a key names, in the refusal: "client", "address"
        self.after = after
        self.duration_s = duration_s
        self._clock = clock
        self._max = max_tracked
        self._strikes: collections.OrderedDict[str, list[float]] = collections.OrderedDict()
        self._until: dict[str, float] = {}

    @property
    def enabled(self) -> bool:
        return self.after > 0

    def remaining_s(self, identity: str) -> float:
        """Seconds of quarantine left for ``identity`` (0 when it is not quarantined)."""
        until = self._until.get(identity)
        if until is None:
            return 0.0
        left = until - self._clock()
        if left <= 0:
            del self._until[identity]
            return 0.0
        return left

    def check(self, identity: str) -> None:
        """Raise `MessageRejectedError` (QUARANTINED) while ``identity`` is quarantined."""
        left = self.remaining_s(identity) if self._until else 0.0
        if left > 0:
            raise MessageRejectedError(
                RejectReason.QUARANTINED,
                f"{self.noun} {identity[:64]!r} is quarantined after repeated invalid "
                f"messages; retry in {left:.0f} s, and fix what the earlier errors named",
            )

    def strike(self, identity: str, reason: RejectReason) -> bool:
        """Count a refusal; True when this strike starts a quarantine."""
        if not self.enabled or reason not in STRIKES or self.remaining_s(identity) > 0:
            return False
        now = self._clock()
        times = [t for t in self._strikes.pop(identity, []) if now - t < self.duration_s]
        times.append(now)
        if len(times) < self.after:
            self._strikes[identity] = times  # most recent last
            while len(self._strikes) > self._max:
                self._strikes.popitem(last=False)
            return False
        self._until[identity] = now + self.duration_s
        if len(self._until) > self._max:  # drop ended quarantines, then the oldest
            for key in [k for k, t in self._until.items() if t <= now]:
                del self._until[key]
            while len(self._until) > self._max:
                del self._until[next(iter(self._until))]
        return True
