"""A client that deals shares its neighbours cannot open, played against the real server.

Threat model: one client is malicious (a valid certificate; honest in every stage but
one). At share keys it seals garbage for every neighbour. Each neighbour refuses the
attempt at masked input (it cannot open the share), and the dealer's own self mask can
then never be recovered, so the attempt fails. Unless the server knows whom to leave
out, the retry keeps the dealer, which sinks it again, round after round, while honest
clients are dropped.

A client's refusal names the dealer (`fedloom.secagg.accusation_failure`); the server
leaves the accused out of the retry (as it leaves out the accusers, who refused), so
each round costs one attempt and finishes without the dealer.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest
from e2e_harness import Behaviour, RecordingClient, secagg, start_runners, stop_runners
from helpers import small_weights

from fedloom.secagg import DealerAccused, ShareKeysReply, accusation_failure, accused_dealer
from fedloom.server import Server

DEALER = 3


def _garbage_shares(task: Any, result: Any, payload: Any) -> tuple[Any, Any]:
    reply = result.secagg
    if isinstance(reply, ShareKeysReply):
        bad = tuple(dataclasses.replace(s, ciphertext=bytes(b ^ 0x55 for b in s.ciphertext))
                    for s in reply.shares)
        result = dataclasses.replace(result, secagg=dataclasses.replace(reply, shares=bad))
    return result, payload


def test_a_dealer_of_bad_shares_costs_an_attempt_not_the_rounds(
        server_config, mtls, pki, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.WARNING, logger="fedloom")
    config = server_config(**mtls, num_rounds=2, min_clients=10, min_fit_clients=8,
                           fraction_evaluate=0.0, secure_aggregation=secagg())
    server = Server(config, initial_weights=small_weights())
    handle = server.start()
    clients = [RecordingClient(seed=i, num_examples=10) for i in range(10)]
    runners, threads = start_runners(handle.address, clients,
                                     {DEALER: Behaviour(tamper=_garbage_shares)}, pki=pki)
    history = handle.wait(120)
    stop_runners(runners, threads)
    dealer = runners[DEALER].client_id
    accusations = [r.getMessage() for r in caplog.records if "accuses client" in r.getMessage()]
    sampled = [r for r in history if r.secure_aggregation.get("attempts", 0) > 1]
    assert sampled, "the dealer was never sampled"
    for record in history:
        assert record.status == "ok", history
    for record in sampled:  # one attempt lost to the dealer, then on without it
        assert record.secure_aggregation["attempts"] == 2
    # named by identity and session (client-3 (<session id>))
    assert accusations and all(f"accuses client client-{DEALER} ({dealer})" in m
                               for m in accusations)


def test_an_accusation_travels_as_a_failure_the_server_reads_back() -> None:
    exc = DealerAccused("dealer-7", "client 'c1' refuses: the share from 'dealer-7' ...")
    failure = accusation_failure(exc)
    assert accused_dealer(failure) == "dealer-7"
    assert accused_dealer(failure[:200]) == "dealer-7"  # the server keeps 200 characters
    for other in ("SecureAggregationError: client 'c1' refuses: ...", "DealerAccused : x",
                  "DealerAccused a b: c", "DealerAccused dealer-7"):
        assert accused_dealer(other) is None
