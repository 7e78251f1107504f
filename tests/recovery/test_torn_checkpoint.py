"""A torn or altered checkpoint is detected on load (its digest is in the run store)
and the previous good round is resumed instead; the run still ends with the same bits
as an uninterrupted one."""

from __future__ import annotations

from pathlib import Path

import pytest
from recovery_support import (
    CRASH_EXIT,
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
)

from fedloom.server.store import RunStore


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    return reference_run(tmp_path_factory.mktemp("recovery"))


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "torn":  # a write cut short (what a rename-less writer leaves)
        path.write_bytes(bytes(data[: len(data) // 2]))
    else:  # one flipped bit in the tensor data (disk or tampering)
        data[-5] ^= 0x10
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["torn", "flipped"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_round(
    tmp_path: Path, reference: Reference, how: str
) -> None:
    port = free_port()
    state_dir = tmp_path / "state"
    server = ServerProcess(tmp_path, run_settings(state_dir, port))
    pool = ClientPool(f"127.0.0.1:{port}")
    try:
        # Die right after round 3 is committed (round 0 is the first commit).
        assert server.wait(server.start("round_committed:4"), 60) == CRASH_EXIT
        store = RunStore(state_dir / "fedloom.db")
        run = store.runs()[-1]
        latest = store.latest_round(run.run_id)
        store.close()
        assert latest is not None and latest.round == 3
        _damage(state_dir / latest.checkpoint, how)
        assert server.wait(server.start(), 60) == 0, server.log_tail()
        pool.join(15.0)
    finally:
        pool.stop.set()
    log = server.log_path.read_text()
    assert "round 3 of run" in log and "is not usable" in log
    assert f"resuming run {run.run_id} after round 2" in log
    weights, state, rounds = final_checkpoint(state_dir)
    assert rounds == list(range(NUM_ROUNDS + 1))  # round 3 was recorded again
    assert_bitwise_equal(weights, reference[0])
    assert_same_state(state, reference[1])
