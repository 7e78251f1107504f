"""Secure rounds end to end over loopback gRPC, with real client loops (threads).

The reference is computed here from what each client actually trained: the plaintext
weighted mean of the survivors' clipped deltas. The server's decoded sums must be
within one quantum per client per coordinate of the plaintext sums, and the new global
model within the bound that implies for the mean (`mean_tolerance`).
"""

from __future__ import annotations

import logging
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from e2e_harness import (
    Behaviour,
    RecordingClient,
    checkpoints,
    mean_tolerance,
    plaintext,
    run_to_end,
    secagg,
    start_runners,
    stop_runners,
    survivor_indices,
)
from helpers import small_weights

from fedloom import Weights
from fedloom.config import StrategyConfig
from fedloom.secagg import Stage, flatten, unflatten
from fedloom.server import Server
from fedloom.server.metrics import ServerMetrics


def test_a_secure_round_equals_plaintext_fedavg_within_the_quantization_error(
        server_config, mtls, pki) -> None:  # type: ignore[no-untyped-def]
    sa = secagg()
    config = server_config(
        **mtls, num_rounds=2, min_clients=6, min_fit_clients=6, keep_checkpoints=5,
                           secure_aggregation=sa)
    server = Server(config, initial_weights=small_weights())
    fits = ServerMetrics.tasks.labels(kind="fit", outcome="accepted")
    fits_before = fits._value.get()
    handle = server.start()
    clients = [RecordingClient(seed=i, num_examples=10 * (i + 1)) for i in range(6)]
    history, runners = run_to_end(handle, clients, pki)
    assert [r.status for r in history] == ["ok", "ok"]
    assert [r.num_updates for r in history] == [6, 6]
    assert fits._value.get() - fits_before == 12  # secure fits count like plain ones
    assert history[0].fit == {"num_updates": 6, "num_examples": 210}  # sums only
    assert set(history[0].secure_aggregation["stage_s"]) == {str(s) for s in Stage}
    assert {"train", *(str(s) for s in Stage)} == set(runners[0].secagg_cpu_s)
    assert all(v >= 0 for v in runners[0].secagg_cpu_s.values())
    # authenticated: every attempt advertises fresh signed keys and runs the consistency
    # check before unmask (which closes once every secret has t shares: some clients'
    # unmask replies are not needed, so unmask is left out of the comparison)
    for runner in runners:
        early = [(r, s) for r, s in runner.stages_pushed if s is not Stage.UNMASK]
        assert early == [(r, s) for r in (1, 2) for s in Stage if s is not Stage.UNMASK]
        assert runner.stats.fits == 2  # secure fits are counted like plain ones
    # the server's sums (last round) within one quantum per client per coordinate
    result = server.coordinator.driver.last_result  # type: ignore[union-attr]
    assert result is not None
    mean, weighted, total_weight = plaintext(clients, list(range(6)), 2, sa)
    assert np.abs(result.weighted_sum - weighted).max() < 6 * sa.quantum
    assert abs(result.total_weight - total_weight) < 6 / sa.levels
    assert abs(result.total_examples - 210) < 6 * sa.max_weight / sa.levels
    # each round's global model: the previous one plus the plaintext mean, to the bound
    saved = checkpoints(config.state_dir)
    for server_round in (1, 2):
        mean, weighted, total_weight = plaintext(clients, list(range(6)), server_round, sa)
        tolerance = mean_tolerance(weighted, total_weight, 6, sa)
        got = flatten(saved[server_round].subtract(saved[server_round - 1]))
        assert np.all(np.abs(got - mean) <= tolerance + 1e-6), np.abs(got - mean).max()
        assert tolerance.max() < 1e-4  # the bound is tight enough to mean something
    # and the exact check fails for a wrong reference (the test can fail)
    wrong, _, _ = plaintext(clients, list(range(5)), 2, sa)
    assert np.abs(flatten(saved[2].subtract(saved[1])) - wrong).max() > 1e-3


@pytest.mark.parametrize("stage", [Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.MASKED_INPUT])
def test_a_client_that_vanishes_after_a_stage_is_noticed_at_once(
        server_config, mtls, pki, stage: Stage,
        caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    """The victim answers the stage, then its task stream ends (no Leave). The others
    answer that stage 1 s later, so the victim is waiting for its next task when it
    vanishes; heartbeat silence (30 s) and stage deadlines (20 s) are far away, so a
    round that finishes in seconds noticed the broken stream."""
    sa = secagg()
    config = server_config(
        **mtls, num_rounds=1, min_clients=7, min_fit_clients=6, long_poll_s=5.0,
                           client_timeout_s=30.0, fraction_evaluate=0.0, secure_aggregation=sa)
    server = Server(config, initial_weights=small_weights())
    handle = server.start()
    clients = [RecordingClient(seed=i, num_examples=5 + 7 * i) for i in range(7)]
    behaviours = {i: Behaviour(delay={stage: 1.0}) for i in range(1, 7)}
    behaviours[0] = Behaviour(vanish_after=stage)
    started = time.monotonic()
    caplog.set_level(logging.INFO, logger="fedloom.server")
    runners, threads = start_runners(handle.address, clients, behaviours, pki=pki)
    history = handle.wait(60)
    elapsed = time.monotonic() - started
    stop_runners(runners, threads)
    assert behaviours[0].vanished.is_set()
    assert history[0].status == "ok", history
    assert elapsed < 15.0
    survivors = survivor_indices(server, runners)
    info = history[0].secure_aggregation
    # gone before its stage closed: left out of the round, nothing to unmask; gone after
    # its masked input was accepted: a survivor that never confirms the survivor set, so
    # no neighbour reveals its self-mask share, and the attempt is retried without it
    assert survivors == list(range(1, 7)) and info["survivors"] == 6
    assert info["dropped"] == 0
    # a participant of the last attempt in neither set: counted, as it cost its
    # neighbours their shares (a retried attempt ran without it)
    assert info["left_out"] == (0 if stage is Stage.MASKED_INPUT else 1)
    # the log names the client by its identity (its certificate's), not only its session
    assert any(re.search(r"client client-0 \(\w+\) dropped", r.getMessage())
               for r in caplog.records)
    if stage is Stage.MASKED_INPUT:
        assert info["attempts"] == 2
        assert "did not confirm the survivor set" in info["failures"][0]
    else:
        assert info["attempts"] == 1
    mean, weighted, total_weight = plaintext(clients, survivors, 1, sa)
    saved = checkpoints(config.state_dir)
    got = flatten(saved[1].subtract(saved[0]))
    tolerance = mean_tolerance(weighted, total_weight, len(survivors), sa)
    assert np.all(np.abs(got - mean) <= tolerance + 1e-6)


def test_a_client_gone_after_sharing_keys_has_its_masks_removed(
        server_config, mtls, pki) -> None:  # type: ignore[no-untyped-def]
    """The victim shared keys, then died computing its masked input: its neighbours
    masked against it, so the server reconstructs its mask key from t shares in the
    unmask stage and removes those masks. Noticed by heartbeat silence (2.5 s)."""
    sa = secagg()
    config = server_config(
        **mtls, num_rounds=1, min_clients=7, min_fit_clients=6, client_timeout_s=2.5,
                           fraction_evaluate=0.0, secure_aggregation=sa)
    server = Server(config, initial_weights=small_weights())
    handle = server.start()
    clients = [RecordingClient(seed=i, num_examples=5 + 7 * i) for i in range(7)]
    behaviours = {0: Behaviour(vanish_on=Stage.MASKED_INPUT)}
    started = time.monotonic()
    runners, threads = start_runners(handle.address, clients, behaviours, pki=pki)
    history = handle.wait(60)
    elapsed = time.monotonic() - started
    stop_runners(runners, threads)
    assert history[0].status == "ok", history
    assert elapsed < 12.0
    info = history[0].secure_aggregation
    assert (info["survivors"], info["dropped"]) == (6, 1)
    survivors = survivor_indices(server, runners)
    assert survivors == list(range(1, 7))
    mean, weighted, total_weight = plaintext(clients, survivors, 1, sa)
    saved = checkpoints(config.state_dir)
    got = flatten(saved[1].subtract(saved[0]))
    assert np.all(np.abs(got - mean) <= mean_tolerance(weighted, total_weight, 6, sa) + 1e-6)


def test_a_silent_client_is_dropped_when_its_heartbeats_stop(
        server_config, mtls, pki) -> None:  # type: ignore[no-untyped-def]
    """A client whose process hangs in training (stopped: no heartbeats, its connection
    still open) is dropped after client_timeout_s, long before the round's deadline, and
    the round finishes without it."""
    sa = secagg()
    config = server_config(
        **mtls, num_rounds=1, min_clients=6, min_fit_clients=6, fraction_fit=1.0,
        client_timeout_s=2.5, round_timeout_s=60.0, fraction_evaluate=0.0,
        secure_aggregation=sa)
    server = Server(config, initial_weights=small_weights())
    handle = server.start()
    hung = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("hanging_client.py")), handle.address,
         str(pki), "5"], stdout=subprocess.PIPE, text=True)
    runners, threads = start_runners(
        handle.address, [RecordingClient(seed=i, num_examples=20) for i in range(5)], pki=pki)
    try:
        assert hung.stdout is not None
        assert select.select([hung.stdout], [], [], 30)[0], "the hanging client never fitted"
        assert hung.stdout.readline().strip() == "fitting"  # every client is sampled
        hung.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        history = handle.wait(60)
        elapsed = time.monotonic() - started
        assert hung.poll() is None  # still there, sockets open: only silence told
    finally:
        hung.kill()
        hung.wait(10)
        stop_runners(runners, threads)
    assert history[0].status == "ok" and history[0].num_updates == 5
    assert elapsed < 12.0


def test_too_few_survivors_fail_the_round_cleanly_and_the_next_one_runs(
        server_config, mtls, pki) -> None:  # type: ignore[no-untyped-def]
    # k = 6, t = 4: a round needs 5 clients that shared keys. Round 1 samples 5, two
    # vanish after advertising (noticed at once: broken streams) and come back as new
    # sessions; round 2 samples all 7 sessions, and the two dead ones are dropped when
    # their heartbeats time out (3 s): 5 remain, each with 4 neighbours (complete graph).
    sa = secagg(neighbours=6, threshold=4)
    config = server_config(
        **mtls, num_rounds=2, min_clients=5, min_fit_clients=5, long_poll_s=2.0,
                           client_timeout_s=3.0, keep_checkpoints=5, fraction_evaluate=0.0,
                           secure_aggregation=sa)
    server = Server(config, initial_weights=small_weights())
    handle = server.start()
    clients = [RecordingClient(seed=i, num_examples=30) for i in range(5)]
    behaviours = {i: Behaviour(delay={Stage.ADVERTISE_KEYS: 1.0}) for i in (2, 3, 4)}
    for i in (0, 1):  # vanish after advertising in round 1, come back as new sessions
        behaviours[i] = Behaviour(vanish_after=Stage.ADVERTISE_KEYS, stay_away=False)
    runners, threads = start_runners(handle.address, clients, behaviours, pki=pki)
    history = handle.wait(60)
    stop_runners(runners, threads)
    assert [r.status for r in history] == ["failed", "ok"], history
    assert "at least 5 are needed" in history[0].secure_aggregation["failure"]
    saved = checkpoints(config.state_dir)
    assert saved[1].allclose(saved[0], rtol=0, atol=0)  # the global model is unchanged
    assert not saved[2].allclose(saved[1], rtol=0, atol=1e-3)
    assert history[1].num_updates == 5


def test_fedadam_composes_with_secure_aggregation(
        server_config, mtls, pki) -> None:  # type: ignore[no-untyped-def]
    """FedAdam's server step applied to the secure mean equals FedAdam over the plain
    updates (the oracle: our FedAdam, itself checked against Flower's)."""
    from fedloom.strategies import FedAdam
    from fedloom.types import ClientUpdate

    sa = secagg()
    config = server_config(
        **mtls, num_rounds=1, min_clients=5, min_fit_clients=5, secure_aggregation=sa,
                           strategy=StrategyConfig("fedadam", {"eta": 0.1}))
    server = Server(config, initial_weights=small_weights())
    handle = server.start()
    clients = [RecordingClient(seed=i, num_examples=10 + i) for i in range(5)]
    history, _ = run_to_end(handle, clients, pki)
    assert history[0].status == "ok"
    initial = small_weights()
    updates = []
    for i, c in enumerate(clients):
        vector, n = c.delta(1)  # type: ignore[misc]
        delta = unflatten(np.clip(vector, -sa.clip_range, sa.clip_range), initial.specs())
        delta = Weights((k, v.astype(np.float32)) for k, v in delta.items())
        updates.append(ClientUpdate(f"c{i}", delta, n, 0))
    expected = FedAdam(eta=0.1).aggregate_fit(1, initial, updates).weights
    assert expected is not None
    got = checkpoints(config.state_dir)[1]
    assert got.allclose(expected, rtol=0, atol=1e-4)
    assert not got.allclose(initial, rtol=0, atol=1e-2)


def test_a_round_restarted_by_a_server_restart_gets_a_new_attempt_and_fresh_keys(
        server_config, mtls, pki) -> None:  # type: ignore[no-untyped-def]
    """The server stops in round 1's share-keys stage and a new one resumes the run:
    round 1 runs again under a larger attempt id, and every client advertises new keys."""
    import socket

    from fedloom.secagg import AdvertisedKeys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    sa = secagg()
    config = server_config(**mtls, address=f"127.0.0.1:{port}", num_rounds=1, min_clients=5,
                           min_fit_clients=5, fraction_evaluate=0.0, secure_aggregation=sa)
    first = Server(config, initial_weights=small_weights())
    handle = first.start()
    clients = [RecordingClient(seed=i, num_examples=12) for i in range(5)]
    behaviours = {i: Behaviour(delay={Stage.SHARE_KEYS: 0.5}) for i in range(5)}
    runners, threads = start_runners(handle.address, clients, behaviours, pki=pki)
    deadline = time.monotonic() + 30
    assert first.coordinator is not None
    while first.coordinator.driver.running != (1, Stage.SHARE_KEYS):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    handle.stop()  # abrupt: round 1 is not committed
    handle.wait(30)
    assert first.coordinator.driver.last_setup is not None
    stopped_attempt = first.coordinator.driver.last_setup.round_id.attempt
    second = Server(config, initial_weights=small_weights())
    history = second.start().wait(60)
    stop_runners(runners, threads)
    assert [r.status for r in history] == ["ok"]
    assert history[0].secure_aggregation["attempt"] > stopped_attempt
    for runner in runners:
        keys = [r.secagg for r in runner.results if isinstance(r.secagg, AdvertisedKeys)]
        assert [k.round_id.attempt for k in keys] == [stopped_attempt,
                                                     history[0].secure_aggregation["attempt"]]
        assert keys[0].mask_public_key != keys[1].mask_public_key
        assert keys[0].cipher_public_key != keys[1].cipher_public_key


def test_without_a_client_pki_secure_rounds_need_an_explicit_opt_in(server_config) -> None:  # type: ignore[no-untyped-def]
    from fedloom.errors import ConfigError

    with pytest.raises(ConfigError, match="allow_unauthenticated"):
        server_config(min_clients=6, min_fit_clients=6, secure_aggregation=secagg())


def test_an_unauthenticated_round_runs_on_key_offers_and_warns(server_config, caplog) -> None:  # type: ignore[no-untyped-def]
    """allow_unauthenticated (plaintext, no client PKI): honest-but-curious only, said
    loudly at start; round 2 runs on the keys each client offered in round 1 (no
    advertise stage) and neither round has a consistency stage."""
    sa = secagg(allow_unauthenticated=True)
    config = server_config(num_rounds=2, min_clients=6, min_fit_clients=6, keep_checkpoints=5,
                           fraction_evaluate=0.0, secure_aggregation=sa)
    server = Server(config, initial_weights=small_weights())
    with caplog.at_level("WARNING", logger="fedloom.server"):
        handle = server.start()
    assert "WITHOUT A CLIENT PKI" in caplog.text and "honest-but-curious" in caplog.text
    clients = [RecordingClient(seed=i, num_examples=10 * (i + 1)) for i in range(6)]
    runners, threads = start_runners(handle.address, clients)
    history = handle.wait(60)
    stop_runners(runners, threads)
    assert [r.status for r in history] == ["ok", "ok"]
    for runner in runners:
        early = [(r, s) for r, s in runner.stages_pushed if s is not Stage.UNMASK]
        assert early == [(1, Stage.ADVERTISE_KEYS), (1, Stage.SHARE_KEYS),
                         (1, Stage.MASKED_INPUT), (2, Stage.SHARE_KEYS), (2, Stage.MASKED_INPUT)]
    saved = checkpoints(config.state_dir)
    mean, weighted, total_weight = plaintext(clients, list(range(6)), 2, sa)
    got = flatten(saved[2].subtract(saved[1]))
    assert np.all(np.abs(got - mean) <= mean_tolerance(weighted, total_weight, 6, sa) + 1e-6)
