"""Kill the server at every named crash point; the same command resumes the run and
ends with the same model and strategy state, bit for bit, as an uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import pytest
from recovery_support import (
    NUM_CLIENTS,
    NUM_ROUNDS,
    Reference,
    assert_bitwise_equal,
    assert_same_state,
    final_checkpoint,
    reference_run,
    run_with_restarts,
)

from fedloom.records import RoundRecord
from fedloom.server.crashpoints import POINTS, parse
from fedloom.server.store import RunStore

# (crash spec, what it interrupts). Hit counts: the commit points are reached once per
# round from round 0 (the run's initial commit); mid_aggregation once per update
# folded (3 clients a round).
MID_RUN = [
    ("mid_aggregation:8", "round 3, after its second update was folded"),
    ("checkpoint_temp_written:3", "round 2: temp checkpoint durable, not renamed"),
    ("checkpoint_renamed:3", "round 2: file in place, database not yet updated"),
    ("round_committed:3", "round 2: database committed, old checkpoints not yet pruned"),
]


def test_every_named_point_is_covered() -> None:
    covered = {parse(spec)[0] for spec, _ in MID_RUN}
    # mid_secure_aggregation is reached only by secure rounds (test_secure_crash.py),
    # async_update_kept only by asynchronous rounds (tests/recovery/test_async_crash.py)
    # and mid_evaluation only with federated evaluation (below)
    assert covered | {"mid_secure_aggregation", "async_update_kept", "mid_evaluation"} == set(
        POINTS)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    return reference_run(tmp_path_factory.mktemp("recovery"))


@pytest.mark.parametrize(("crash", "where"), MID_RUN, ids=[c for c, _ in MID_RUN])
def test_killed_at_a_named_point_resumes_to_the_same_model(
    tmp_path: Path, reference: Reference, crash: str, where: str
) -> None:
    server, pool = run_with_restarts(tmp_path, [crash])
    weights, state, rounds = final_checkpoint(tmp_path / "state")
    want_weights, want_state, _ = reference
    assert rounds[-1] == NUM_ROUNDS
    assert_bitwise_equal(weights, want_weights)
    assert_same_state(state, want_state)
    # Connected clients carried on by themselves, through a restart, to the end.
    assert server.starts == 2
    assert len(pool.stats) == len(pool.clients)
    assert all(s.run_finished for s in pool.stats.values()), pool.stats


def test_killed_before_the_run_committed_round_0_starts_it_again(
    tmp_path: Path, reference: Reference
) -> None:
    # Three deaths in a row, each before round 0 is recorded, then one after it.
    run_with_restarts(
        tmp_path,
        ["checkpoint_temp_written:1", "checkpoint_renamed:1", "round_committed:1"],
    )
    weights, state, _ = final_checkpoint(tmp_path / "state")
    assert_bitwise_equal(weights, reference[0])
    assert_same_state(state, reference[1])
    assert not list((tmp_path / "state" / "checkpoints").rglob("*.tmp"))


def test_killed_while_clients_evaluate_keeps_the_round_and_evaluates_it_on_resume(
    tmp_path: Path, reference: Reference
) -> None:
    # Federated evaluation every round, 3 results a round: the 5th result taken is round
    # 2's second. The round was committed before its model went to the evaluation.
    server, pool = run_with_restarts(tmp_path, ["mid_evaluation:5"], fraction_evaluate=1.0,
                                     min_evaluate_clients=NUM_CLIENTS)
    weights, state, rounds = final_checkpoint(tmp_path / "state")
    assert rounds[-1] == NUM_ROUNDS
    assert_bitwise_equal(weights, reference[0])
    assert_same_state(state, reference[1])
    # Round 2 was trained once: the restart evaluated its committed model instead.
    assert all(c.rounds == list(range(1, NUM_ROUNDS + 1)) for c in pool.clients), [
        c.rounds for c in pool.clients]
    assert server.starts == 2
    assert "round 2 was committed but not evaluated; evaluating it" in server.log_tail(400)
    store = RunStore(tmp_path / "state" / "fedloom.db")
    try:
        (run,) = store.runs()
        records = [RoundRecord.from_dict(r.metrics) for r in store.rounds(run.run_id)]
    finally:
        store.close()
    for record in records[1:]:
        assert not record.evaluation_pending, record.round
        # every client's loss is 0.0; 1 + 2 + 3 examples
        assert dict(record.evaluate) == {"loss": 0.0, "num_examples": 6}, record


# 2 of 3 clients fit and 1 of 3 evaluates each round, both drawn from the seeded sampler.
SAMPLED = {"fraction_fit": 0.67, "min_fit_clients": 2, "fraction_evaluate": 0.34,
           "min_evaluate_clients": 1}


@pytest.mark.parametrize("crash", ["mid_aggregation:5", "checkpoint_renamed:4",
                                   "mid_evaluation:2"])
def test_a_resume_draws_the_samples_an_uninterrupted_run_draws(
        tmp_path: Path, crash: str) -> None:
    # mid_aggregation:5 is round 3's first update (2 a round): round 2 committed and
    # evaluated; a resume from round 2's checkpoint must sample round 3's clients as
    # the uninterrupted run does, although round 2's evaluation drew a sample since.
    want_weights, want_state, _ = reference_run(tmp_path / "reference", **SAMPLED)
    run_with_restarts(tmp_path, [crash], **SAMPLED)
    weights, state, rounds = final_checkpoint(tmp_path / "state")
    assert rounds[-1] == NUM_ROUNDS
    assert_bitwise_equal(weights, want_weights)
    assert_same_state(state, want_state)
