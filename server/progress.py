"""The server's live display: the round, clients, loss and accuracy (rich)."""

from __future__ import annotations

import logging
from typing import Any

from rich.console import Console
from rich.table import Table

from fedloom.types import TaskKind

log = logging.getLogger("fedloom.server")


def _pick(record: dict[str, Any], key: str) -> Any:
    """A metric from server-side evaluation, else from federated evaluation."""
    for source in ("server", "evaluate"):
        value = record.get(source, {}).get(key)
        if value is not None:
            return value
    return None


def _fmt(value: Any, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


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

    def round_finished(self, record: dict[str, Any]) -> None:
        loss, acc = _pick(record, "loss"), _pick(record, "accuracy")
        log.info(
            "round %s %s: loss=%s accuracy=%s updates=%s",
            record.get("round"),
            record.get("status"),
            _fmt(loss),
            _fmt(acc),
            record.get("num_updates", "-"),
            extra={
                "round": record.get("round"),
                "status": record.get("status"),
                "loss": loss,
                "accuracy": acc,
                "updates": record.get("num_updates"),
                "failures": record.get("num_failures"),
                "cancelled": record.get("num_cancelled"),
                "duration_s": record.get("duration_s"),
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
        fit_loss = record.get("fit", {}).get("train_loss")
        clients = (
            f"{record.get('num_updates')}/{record.get('num_sampled')}"
            if "num_sampled" in record
            else "-"
        )
        table.add_row(
            str(record.get("round")),
            str(record.get("status", "")),
            clients,
            _fmt(fit_loss),
            _fmt(loss),
            _fmt(acc),
            _fmt(record.get("duration_s"), ".2f"),
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
