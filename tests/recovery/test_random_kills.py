"""SIGKILL the server at random moments (seeded), restart it with the same command each
time: the run ends with the same bits as an uninterrupted run, and the clients, which
were never restarted, carry on by themselves to the end."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest
from recovery_support import (
    NUM_ROUNDS,
    ClientPool,
    Reference,
    ServerProcess,
    assert_bitwise_equal,
    assert_same_state,
    final_checkpoint,
    free_port,
    reference_run,
    run_settings,
    run_state,
)

KILLS = int(os.environ.get("FEDLOOM_RANDOM_KILLS", "8"))  # more for a longer soak
ROUND_S = 0.2  # each client "trains" this long, so rounds last about as long


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    return reference_run(tmp_path_factory.mktemp("recovery"))


def test_random_sigkills_leave_the_final_model_intact(tmp_path: Path, reference: Reference) -> None:
    rng = random.Random(int(os.environ.get("FEDLOOM_RANDOM_KILLS_SEED", "6")))
    port = free_port()
    state_dir = tmp_path / "state"
    server = ServerProcess(tmp_path, run_settings(state_dir, port))
    pool = ClientPool(f"127.0.0.1:{port}", fit_delay_s=ROUND_S)
    kills: list[tuple[float, int]] = []  # (seconds after start, rounds committed then)
    try:
        finished = False
        committed = -1
        while len(kills) < KILLS:
            proc = server.start()
            started = time.monotonic()
            if rng.random() < 0.25:  # while it starts up (imports, opening the run)
                time.sleep(rng.uniform(0.05, 1.0))
            elif server.wait_until_serving(proc):  # while it serves: joins, rounds, commits
                time.sleep(rng.uniform(0.0, 2.5 * ROUND_S))  # a round or two of progress
            delay = time.monotonic() - started
            if proc.poll() is not None:  # the run ended before the kill
                assert proc.returncode == 0, server.log_tail()
                finished = True
                break
            server.kill(proc)
            _, status, committed = run_state(state_dir)
            kills.append((round(delay, 2), committed))
            if status == "finished":  # killed while saying goodbye: nothing left to run
                finished = True
                break
        if not finished:
            assert server.wait(server.start(), 60) == 0, server.log_tail()
        pool.join(15.0)
    finally:
        pool.stop.set()
    weights, state, rounds = final_checkpoint(state_dir)
    assert rounds[-1] == NUM_ROUNDS
    assert_bitwise_equal(weights, reference[0])
    assert_same_state(state, reference[1])
    assert all(s.run_finished for s in pool.stats.values()), pool.stats
    print(f"kills (delay s, last committed round): {kills}")
    assert len(kills) >= 3, kills
