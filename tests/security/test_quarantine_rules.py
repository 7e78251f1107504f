"""The quarantine's rules, one by one, on a fake clock: what counts as a strike, the
window strikes are counted in, how long a quarantine lasts, what the refusal says, and
the bound on what is remembered."""

from __future__ import annotations

import pytest

from fedloom.errors import MessageRejectedError, RejectReason
from fedloom.server.quarantine import STRIKES, Quarantine


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _quarantine(after: int = 3, duration_s: float = 60.0, **kwargs: object
                ) -> tuple[Quarantine, Clock]:
    clock = Clock()
    return Quarantine(after, duration_s, clock=clock, **kwargs), clock  # type: ignore[arg-type]


def test_the_after_th_strike_within_the_window_starts_it() -> None:
    q, clock = _quarantine(after=3)
    assert [q.strike("a", RejectReason.INVALID) for _ in range(2)] == [False, False]
    assert q.remaining_s("a") == 0.0
    q.check("a")  # not yet quarantined: no refusal
    clock.now += 10
    assert q.strike("a", RejectReason.INVALID) is True
    assert q.remaining_s("a") == 60.0
    clock.now += 59.5
    assert q.remaining_s("a") == pytest.approx(0.5)
    clock.now += 0.5
    assert q.remaining_s("a") == 0.0  # ended exactly at duration_s
    q.check("a")


def test_strikes_older_than_the_window_do_not_count() -> None:
    q, clock = _quarantine(after=2, duration_s=60.0)
    assert q.strike("a", RejectReason.INVALID) is False
    clock.now += 60.0  # the first strike is now exactly duration_s old: out of the window
    assert q.strike("a", RejectReason.INVALID) is False
    clock.now += 59.9
    assert q.strike("a", RejectReason.INVALID) is True  # the second is still in it


@pytest.mark.parametrize("reason", sorted(set(RejectReason) - STRIKES, key=str))
def test_refusals_honest_clients_also_get_are_not_strikes(reason: RejectReason) -> None:
    q, _ = _quarantine(after=1)
    assert q.strike("a", reason) is False
    assert q.remaining_s("a") == 0.0


def test_stale_and_unknown_session_are_not_strikes_but_invalid_ones_are() -> None:
    assert RejectReason.STALE not in STRIKES and RejectReason.UNKNOWN_CLIENT not in STRIKES
    assert {RejectReason.INVALID, RejectReason.FORBIDDEN, RejectReason.CONFLICT,
            RejectReason.TOO_LARGE, RejectReason.TIMEOUT} == STRIKES


def test_after_zero_disables_it() -> None:
    q, _ = _quarantine(after=0)
    assert not q.enabled
    assert not any(q.strike("a", RejectReason.INVALID) for _ in range(50))


def test_strikes_during_a_quarantine_do_not_extend_it() -> None:
    q, clock = _quarantine(after=1, duration_s=60.0)
    assert q.strike("a", RejectReason.INVALID) is True
    clock.now += 30
    assert q.strike("a", RejectReason.INVALID) is False
    assert q.remaining_s("a") == pytest.approx(30.0)


def test_the_refusal_names_what_and_for_how_long() -> None:
    q, _ = _quarantine(after=1, duration_s=42.0, noun="address")
    q.strike("ipv4:10.0.0.7", RejectReason.CONFLICT)
    with pytest.raises(MessageRejectedError) as info:
        q.check("ipv4:10.0.0.7")
    assert info.value.reason is RejectReason.QUARANTINED
    assert "address 'ipv4:10.0.0.7' is quarantined" in str(info.value)
    assert "retry in 42 s" in str(info.value)
    q.check("ipv4:10.0.0.8")  # another key is not affected


def test_identities_are_counted_apart() -> None:
    q, _ = _quarantine(after=2)
    q.strike("a", RejectReason.INVALID)
    assert q.strike("b", RejectReason.INVALID) is False
    assert q.strike("a", RejectReason.INVALID) is True
    assert q.remaining_s("b") == 0.0


def test_memory_is_bounded_and_the_stalest_strikes_go_first() -> None:
    q, clock = _quarantine(after=2, max_tracked=3)
    for name in ("a", "b", "c"):
        q.strike(name, RejectReason.INVALID)
        clock.now += 1
    q.strike("d", RejectReason.INVALID)  # a fourth: "a" (the stalest) is forgotten
    assert q.strike("a", RejectReason.INVALID) is False  # its first strike was dropped
    assert q.strike("c", RejectReason.INVALID) is True  # "c" was kept


def test_quarantines_are_bounded_too_ended_ones_dropped_first() -> None:
    q, clock = _quarantine(after=1, duration_s=10.0, max_tracked=2)
    assert q.strike("a", RejectReason.INVALID) is True
    clock.now += 11  # "a" has ended
    assert q.strike("b", RejectReason.INVALID) is True
    assert q.strike("c", RejectReason.INVALID) is True  # "a" dropped (ended), b and c kept
    assert q.remaining_s("b") > 0 and q.remaining_s("c") > 0
    assert q.strike("d", RejectReason.INVALID) is True  # over the bound: the oldest, b, goes
    assert q.remaining_s("b") == 0.0
    assert q.remaining_s("c") > 0 and q.remaining_s("d") > 0


def test_a_strike_in_the_last_second_of_a_quarantine_does_not_renew_it() -> None:
    q, clock = _quarantine(after=1, duration_s=60.0)
    q.strike("a", RejectReason.INVALID)
    clock.now += 59.5
    assert q.strike("a", RejectReason.INVALID) is False
    assert q.remaining_s("a") == pytest.approx(0.5)


def test_the_refusal_names_a_client_by_default_and_cuts_long_identities() -> None:
    q, _ = _quarantine(after=1)
    long_name = "x" * 64 + "TAIL"
    q.strike(long_name, RejectReason.INVALID)
    with pytest.raises(MessageRejectedError) as info:
        q.check(long_name)
    assert f"client {'x' * 64!r} is quarantined" in str(info.value)  # the first 64 only


def test_a_full_table_keeps_its_active_quarantines() -> None:
    q, clock = _quarantine(after=1, duration_s=20.0, max_tracked=2)
    q.strike("b", RejectReason.INVALID)  # until 120: the oldest, and active throughout
    clock.now += 1
    q.duration_s = 10.0
    q.strike("a", RejectReason.INVALID)  # until 111
    assert q.remaining_s("b") > 0 and q.remaining_s("a") > 0  # at the bound: both kept
    clock.now = 111.0  # "a" ends exactly now
    q.duration_s = 20.0
    q.strike("c", RejectReason.INVALID)  # over the bound: the ended one goes, not "b"
    assert q.remaining_s("b") == pytest.approx(9.0)
    assert q.remaining_s("c") == pytest.approx(20.0)
