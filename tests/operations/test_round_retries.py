"""``round_retries``: a failed round is run again (a new sample, new tasks) before it
counts as failed; without it the failure is committed and the next round starts."""

from __future__ import annotations

import pytest
from helpers import ScriptedClient, run_clients, small_weights

from fedloom.server import Server


class FailsOnce(ScriptedClient):
    """Reports a failure for its first fit (say, out of memory), then trains."""

    def __init__(self, seed: int, num_examples: int) -> None:
        super().__init__(seed, num_examples)
        self.calls = 0

    def fit(self, weights, config):  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("out of memory")
        return super().fit(weights, config)


@pytest.mark.parametrize(("retries", "statuses"), [(0, ["failed", "ok"]), (1, ["ok", "ok"])])
def test_a_failed_round_is_run_again_when_asked(server_config, retries: int,  # type: ignore[no-untyped-def]
                                                statuses: list[str],
                                                caplog: pytest.LogCaptureFixture) -> None:
    config = server_config(num_rounds=2, min_clients=2, min_fit_clients=2,
                           fraction_evaluate=0.0, round_retries=retries)
    handle = Server(config, initial_weights=small_weights()).start()
    clients = [FailsOnce(seed=0, num_examples=5), ScriptedClient(seed=1, num_examples=5)]
    threads = run_clients(handle.address, clients)
    history = handle.wait(60)
    for t in threads:
        t.join(10)
    assert [r.status for r in history if r.round > 0] == statuses
    assert not [r for r in caplog.records if "produced a model" in r.getMessage()]  # one did
    if retries:  # the retried attempt was never committed: its reason is in the log
        assert ("round 1 failed: 1 of 2 sampled clients returned an update; at least 2 "
                "needed; running it again (1 of 1 retries)") in [
            r.getMessage() for r in caplog.records]
    # A failed round says why, in its record (and so in the run store and `fedloom runs`).
    assert [r.reason for r in history if r.round > 0] == [
        "1 of 2 sampled clients returned an update; at least 2 needed" if s == "failed"
        else "" for s in statuses]
    # Round 1 was tried twice when retried: the failing client trained on its second try.
    assert clients[0].calls == (3 if retries else 2)
