"""`fedloom demo --secure-aggregation [--drop-clients N]`: the demo under SecAgg+.

The server learns only the weighted sum of the clients' updates (Bell et al., CCS 2020;
Bonawitz et al., CCS 2017; docs/secure-aggregation.md). With ``--drop-clients N`` the
demo kills N client processes (SIGKILL: no goodbye) in round ``--drop-round`` as soon
as that round's masked-input stage opens, i.e. after they shared their keys: the server
notices them gone (a broken stream or silent heartbeats), drops them, and removes the
masks their neighbours added against them with the shares the survivors reveal. The
round completes over the survivors; the killed clients are then started again (a device
coming back), join as new sessions and take part in the rounds after.

Settings chosen for the demo's scale: k = the largest even number below the number of
clients (at most 10), t = k/2 + 1, so each client's secrets survive k/2 - 1 lost
neighbours; ``max_weight`` is the largest client's number of examples (weights near 1
keep the quantization error small).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from fedloom.records import RoundRecord
from fedloom.secagg import SecAggConfig, Stage

log = logging.getLogger("fedloom.demo")


def secure_settings(clients: int, drop_clients: int, max_examples: int) -> dict[str, Any]:
    """`ServerConfig` settings for a secure demo of ``clients`` processes."""
    if clients < 3:
        raise SystemExit("--secure-aggregation needs at least 3 clients")
    k = min(10, (clients - 1) // 2 * 2)
    t = k // 2 + 1
    staying = clients - drop_clients
    if drop_clients < 0 or staying < t + 1:
        raise SystemExit(f"--drop-clients {drop_clients} leaves {staying} of {clients} clients; "
                         f"a secure round needs at least t + 1 = {t + 1}")
    if drop_clients > k - t:
        log.warning("killing %d clients may leave a survivor with fewer than t = %d of its "
                    "k = %d neighbours: that round would then fail (and the next one run)",
                    drop_clients, t, k)
    secagg = SecAggConfig(enabled=True, neighbours=k, threshold=t, clip_range=8.0, bits=24,
                          max_weight=float(max_examples), max_participants=clients,
                          stage_timeout_s=30.0)
    settings: dict[str, Any] = {"secure_aggregation": secagg}
    if drop_clients:  # notice killed clients sooner than the default 30 s of silence
        # (not much sooner: 8 processes training on 2 cores can starve a heartbeat thread
        # for seconds, and a live client wrongly dropped is a dropout too)
        settings.update(heartbeat_interval_s=2.0, long_poll_s=10.0, client_timeout_s=15.0)
    return settings


class ClientKiller:
    """Kills ``count`` client processes when round ``server_round``'s masked-input stage
    opens on ``server`` (a `fedloom.server.Server` running in this process), then starts
    them again with ``respawn(index)``, replacing them in ``processes`` (a list)."""

    def __init__(self, server: Any, processes: list[Any], count: int, server_round: int,
                 respawn: Callable[[int], Any]) -> None:
        self.server, self.processes, self.respawn = server, processes, respawn
        self.count, self.round = count, server_round
        self.killed: list[int] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="demo-killer")
        if count:
            self._thread.start()

    def _watch(self) -> None:
        from fedloom.server.secure import SecureRounds  # the server's extra: at run time only

        while not self._done.wait(0.005):
            coordinator = self.server.coordinator
            driver = coordinator.driver if coordinator is not None else None
            running = driver.running if isinstance(driver, SecureRounds) else None
            if running is None or running[0] < self.round:
                continue
            if running == (self.round, Stage.MASKED_INPUT) or running[0] > self.round:
                self.killed = list(range(len(self.processes) - self.count, len(self.processes)))
                for index in self.killed:
                    self.processes[index].kill()  # SIGKILL: the client says nothing
                log.warning("killed clients %s in round %d (after they shared keys)",
                            self.killed, self.round)
                for index in self.killed:
                    self.processes[index].join(5)
                    self.processes[index] = self.respawn(index)
                return

    def close(self) -> None:
        self._done.set()


def describe(history: list[RoundRecord], killer: ClientKiller | None) -> str:
    """One line per secure round that lost clients (for the demo's summary)."""
    lines = []
    for record in history:
        info = record.secure_aggregation
        if not info or record.num_failures == 0:
            continue
        if "failure" in info:
            lines.append(f"round {record.round}: failed ({info['failure']}); the global "
                         "model was kept and the next round ran")
            continue
        lines.append(
            f"round {record.round}: {info['survivors']} of {record.num_sampled} clients' "
            f"updates aggregated; {info['dropped']} dropped after sharing keys (their masks "
            f"removed with their neighbours' shares), "
            f"{record.num_sampled - info['survivors'] - info['dropped']} left out earlier")
    if killer is not None and killer.killed:
        lines.insert(0, f"killed client processes {killer.killed} in round {killer.round} "
                        "(then started again: they joined the later rounds as new sessions)")
    return "\n".join(lines)
