"""Per-round plots label whole rounds only: a 3-round run has no tick at round 2.5."""

from __future__ import annotations

import pytest

from fedloom.simulations import History, RoundRecord
from fedloom.simulations.demo import history_figure

pytest.importorskip("matplotlib")


def _round_ticks(axis) -> list[float]:  # type: ignore[no-untyped-def]
    low, high = axis.get_xlim()
    return [t for t in axis.get_xticks() if low <= t <= high]


def _assert_whole(ticks: list[float]) -> None:
    assert ticks, "no ticks in view"
    assert all(float(t).is_integer() for t in ticks), ticks


def test_a_simulation_history_plot_ticks_whole_rounds() -> None:
    rounds = [RoundRecord(r, server={"test_accuracy": 0.2 * r + 0.1, "test_loss": 2.0 - 0.5 * r})
              for r in range(4)]
    fig = History("local", rounds).figure()
    axes = fig.get_axes()
    assert len(axes) == 2
    for axis in axes:
        _assert_whole(_round_ticks(axis))


def test_the_demo_plot_ticks_whole_rounds() -> None:
    history = [RoundRecord(r, server={"accuracy": 0.3 * r, "loss": 2.0 / (r + 1)})
               for r in range(4)]
    fig = history_figure(history)
    _assert_whole(_round_ticks(fig.get_axes()[0]))
