"""A server killed between two stages of a secure (SecAgg+) round resumes: the round
runs again as a new attempt (fresh keys), and the run ends with the model of an
uninterrupted secure run, to the quantization error. (The secure round driver reaches
the ``mid_secure_aggregation`` crash point after each stage closes.)
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from recovery_support import (
    CRASH_EXIT,
    NUM_ROUNDS,
    ClientPool,
    ServerProcess,
    final_checkpoint,
    free_port,
    initial_weights,
    run_settings,
    server_config,
)

from fedloom.server import Server

CLIENTS = 5


def _settings(state_dir: Path, port: int) -> dict:
    return run_settings(
        state_dir,
        port,
        min_clients=CLIENTS,
        min_fit_clients=CLIENTS,
        strategy={"name": "fedavg"},
        secure_aggregation={
            "enabled": True, "neighbours": 4, "threshold": 3, "max_weight": 100.0,
            "max_participants": 64, "bits": 24, "stage_timeout_s": 20.0,
            "allow_unauthenticated": True,  # plaintext client processes: no client PKI
        },
    )  # fmt: skip


def test_killed_mid_secure_round_resumes_with_a_new_attempt(tmp_path: Path) -> None:
    # The uninterrupted secure run, in-process.
    ref_dir = tmp_path / "reference"
    port = free_port()
    handle = Server(
        server_config(_settings(ref_dir, port)), initial_weights=initial_weights()
    ).start()
    pool = ClientPool(handle.address, num_clients=CLIENTS)
    history = handle.wait(90)
    pool.join(15)
    assert [r.status for r in history] == ["ok"] * NUM_ROUNDS
    want, _, _ = final_checkpoint(ref_dir)
    # Killed after the second stage of round 3's attempt (stages close one hit each).
    port = free_port()
    folder = tmp_path / "crashed"
    folder.mkdir()
    server = ServerProcess(folder, _settings(folder / "state", port))
    pool = ClientPool(f"127.0.0.1:{port}", num_clients=CLIENTS)
    try:
        hit = 2 * 4 + 2  # rounds 1-2 close four stages each
        assert server.wait(server.start(f"mid_secure_aggregation:{hit}"), 90) == CRASH_EXIT
        assert server.wait(server.start(), 90) == 0, server.log_tail()
        pool.join(15)
    finally:
        pool.stop.set()
    got, _, rounds = final_checkpoint(folder / "state")
    assert rounds[-1] == NUM_ROUNDS
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-4, err_msg=name)
    second = server.log_path.read_text().split("==== start 2")[1]
    assert "after round 2" in second  # round 3 was not committed by the first process
    assert re.search(r"secure round 3: \S+ closed", second)  # ... and ran again here
