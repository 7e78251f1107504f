"""The server's live display: the round, clients, loss and accuracy (rich)."""

from __future__ import annotations

import logging
from typing import Any

from rich.console import Console
from rich.table import Table

from fedloom.records import RoundRecord
from fedloom.types import TaskKind

log = logging.getLogger("fedloom.server")


def _fmt(value: Any, spec: str = ".4f") -> str:
    if value is None:
        return "-"
    # A strategy's metrics hook may report a loss or accuracy that is not a number.
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    return format(value, spec)


class RoundReporter:
    """Prints one table row per round and a status line while a round runs."""

    def __init__(self, enabled: bool = True, console: Console | None = None) -> None:
        self.enabled = enabled
        self.console = console or Console(stderr=True)
        self._status: Any = None
        self._header_printed = False

    def waiting(self, connected: int, needed: int) -> None:
        if self.enabled:
            self._set_status(f"waiting for clients: {connected}/{needed} connected")

    def round_started(self, server_round: int, num_rounds: int, sampled: int) -> None:
        self._round, self._rounds = server_round, num_rounds
        if self.enabled:
            self._set_status(f"round {server_round}/{num_rounds}: 0/{sampled} clients answered")

    def progress(self, server_round: int, kind: TaskKind, answered: int, total: int) -> None:
        if self.enabled:
            verb = "trained" if kind is TaskKind.FIT else "evaluated"
            self._set_status(f"round {server_round}: {answered}/{total} clients {verb}")

    def round_finished(self, record: RoundRecord) -> None:
        headline = record.headline
        loss, acc = headline.get("loss"), headline.get("accuracy")
        trained = record.round > 0  # round 0 only evaluates the initial model
        log.info(
            "round %s %s: loss=%s accuracy=%s updates=%s",
            record.round,
            record.status,
            _fmt(loss),
            _fmt(acc),
            record.num_updates if trained else "-",
            extra={
                "round": record.round,
                "status": record.status,
                "loss": loss,
                "accuracy": acc,
                "updates": record.num_updates if trained else None,
                "failures": record.num_failures if trained else None,
                "cancelled": record.num_cancelled if trained else None,
                "duration_s": record.duration_s if trained else None,
            },
        )
        if not self.enabled:
            return
        self._clear_status()
        table = Table(show_header=not self._header_printed, box=None, pad_edge=False)
        for column, width in (
            ("round", 5),
            ("status", 6),
            ("clients", 7),
            ("train loss", 10),
            ("loss", 8),
            ("accuracy", 8),
            ("seconds", 7),
        ):
            table.add_column(column, justify="right", min_width=width)
        clients = f"{record.num_updates}/{record.num_sampled}" if trained else "-"
        table.add_row(
            str(record.round),
            record.status,
            clients,
            _fmt(record.fit.get("train_loss")),
            _fmt(loss),
            _fmt(acc),
            _fmt(record.duration_s if trained else None, ".2f"),
        )
        self.console.print(table)
        self._header_printed = True

    def _set_status(self, text: str) -> None:
        if self._status is None:
            self._status = self.console.status(text)
            self._status.start()
        else:
            self._status.update(text)

    def _clear_status(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None

    def close(self) -> None:
        self._clear_status()
