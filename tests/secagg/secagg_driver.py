"""Drive a SecAggServer and N SecAggClient objects in-process, recording the transcript.

Rounds are authenticated by default: every client gets a certificate from a throwaway
client CA (`pki`), signs its keys and confirmations, and checks everyone else's.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fedloom import certs
from fedloom.errors import MessageRejectedError, SecureAggregationError
from fedloom.secagg import (
    KeyOffer,
    PeerVerifier,
    RoundId,
    RoundSetup,
    SecAggClient,
    SecAggConfig,
    SecAggServer,
    SecAggStatus,
    SigningIdentity,
    Stage,
    public_bytes,
)

#: What every test round binds as its model and fit config.
MODEL_DIGEST = hashlib.sha256(b"test model").digest()
CONFIG_DIGEST = hashlib.sha256(b"test config").digest()


@dataclasses.dataclass(frozen=True)
class Pki:
    """A client CA and a certificate for each client id (the id is the CN)."""

    ca: certs.Issued
    identities: dict[str, SigningIdentity]

    @property
    def verifier(self) -> PeerVerifier:
        return PeerVerifier([self.ca.cert])

    def identity(self, client_id: str) -> SigningIdentity:
        if client_id not in self.identities:
            issued = certs.make_client_cert(self.ca, client_id)
            self.identities[client_id] = SigningIdentity(issued.cert, issued.key)
        return self.identities[client_id]


@functools.lru_cache(maxsize=1)
def pki() -> Pki:
    """One throwaway PKI for the whole test session (certificates are made lazily)."""
    return Pki(certs.make_ca("test client CA"), {})


@dataclasses.dataclass
class Round:
    server: SecAggServer
    clients: dict[str, SecAggClient]
    inputs: dict[str, tuple[np.ndarray, int]]
    # (stage, client, request, reply): everything the server sent and received
    transcript: list[tuple[Stage, str, Any, Any]] = dataclasses.field(default_factory=list)
    refusals: dict[str, str] = dataclasses.field(default_factory=dict)
    rejections: dict[str, str] = dataclasses.field(default_factory=dict)


def make_inputs(ids: list[str], length: int, seed: int = 0, scale: float = 1.0,
                max_examples: int = 100) -> dict[str, tuple[np.ndarray, int]]:
    rng = np.random.default_rng(seed)
    return {cid: (rng.normal(0.0, scale, length), int(rng.integers(1, max_examples + 1)))
            for cid in ids}


def exactly(message: str) -> str:
    """A ``match`` pattern for ``message`` and nothing more."""
    return f"^{re.escape(message)}$"


def refusal(cid: str, why: str) -> str:
    """A ``match`` pattern for exactly the refusal of ``cid`` that says ``why``."""
    return exactly(f"client {cid!r} refuses: {why}")


def ids_of(n: int) -> list[str]:
    return [f"client-{i:03d}" for i in range(n)]


def make_setup(config: SecAggConfig, ids: Sequence[str], length: int,
               round_id: RoundId | None = None, *, authenticated: bool = True) -> RoundSetup:
    return RoundSetup.create(config, round_id or RoundId("run-1", 1, 1), list(ids), length,
                             model_digest=MODEL_DIGEST, config_digest=CONFIG_DIGEST,
                             authenticated=authenticated)


def make_client(cid: str, seed: int = 0, *, authenticated: bool = True,
                **kwargs: Any) -> SecAggClient:
    rng = np.random.default_rng(seed)
    if not authenticated:
        return SecAggClient(cid, rng=rng, **kwargs)
    return SecAggClient(cid, identity=pki().identity(cid), peers=pki().verifier, rng=rng,
                        **kwargs)


def setup_round(config: SecAggConfig, inputs: Mapping[str, tuple[np.ndarray, int]],
                round_id: RoundId | None = None,
                clients: dict[str, SecAggClient] | None = None,
                offers: dict[str, KeyOffer] | None = None,
                authenticated: bool = True) -> Round:
    length = len(next(iter(inputs.values()))[0])
    setup = make_setup(config, list(inputs), length, round_id, authenticated=authenticated)
    if clients is None:
        clients = {cid: make_client(cid, i, authenticated=authenticated)
                   for i, cid in enumerate(sorted(inputs))}
    verifier = pki().verifier if authenticated else None
    return Round(SecAggServer(setup, offers=offers, verifier=verifier), clients, dict(inputs))


Hook = Callable[[Stage, str, Any], Any]


def run(rnd: Round, drop_at: Mapping[str, Stage] | None = None,
        tamper_request: Hook | None = None, tamper_reply: Hook | None = None,
        stop_at: Stage | None = None) -> Round:
    """Run stages until the round succeeds; raises SecureAggregationError if it fails.

    ``stop_at``: return as soon as that stage is open (its requests not yet sent).

    ``drop_at[c] = stage``: client c vanishes instead of answering that stage.
    ``tamper_request`` / ``tamper_reply`` may replace a message in flight.
    """
    drop_at = drop_at or {}
    server = rnd.server
    while server.status is SecAggStatus.RUNNING and server.stage is not stop_at:
        stage = server.stage
        for cid in sorted(server.pending()):
            if drop_at.get(cid) == stage:
                server.drop(cid)
                continue
            request = server.request_for(cid)
            if tamper_request is not None:
                request = tamper_request(stage, cid, request)
            vector, num_examples = rnd.inputs[cid]
            try:
                reply = rnd.clients[cid].handle(request, vector=vector,
                                                num_examples=num_examples)
            except SecureAggregationError as exc:
                rnd.refusals[cid] = str(exc)
                server.drop(cid)
                continue
            if tamper_reply is not None:
                reply = tamper_reply(stage, cid, reply)
            rnd.transcript.append((stage, cid, request, reply))
            try:
                server.receive(cid, reply)
            except MessageRejectedError as exc:
                rnd.rejections[cid] = f"{exc.reason}: {exc}"
                server.drop(cid)
        server.advance()
    return rnd


def plaintext_mean(config: SecAggConfig, inputs: Mapping[str, tuple[np.ndarray, int]],
                   survivors: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray, float]:
    """The reference: (weighted mean, weighted sum, total weight) over the survivors."""
    weighted = sum(np.clip(inputs[c][0], -config.clip_range, config.clip_range)
                   * (inputs[c][1] / config.max_weight) for c in survivors)
    total = sum(inputs[c][1] / config.max_weight for c in survivors)
    assert isinstance(weighted, np.ndarray)
    return weighted / total, weighted, float(total)


def assert_matches_plaintext(config: SecAggConfig, rnd: Round,
                             survivors: Sequence[str]) -> None:
    result = rnd.server.result
    assert result.survivors == tuple(sorted(survivors))
    mean, weighted, weight = plaintext_mean(config, rnd.inputs, result.survivors)
    n = len(survivors)
    # at most one quantum per client per coordinate (clipping aside) ...
    err_sum = n * config.quantum
    err_weight = n / config.levels
    assert np.abs(result.weighted_sum - weighted).max() <= err_sum * (1 + 1e-9)
    assert abs(result.total_weight - weight) <= err_weight * (1 + 1e-9)
    # ... and for the mean (A + ea) / (W + ew) - A / W, bounded by the two errors
    bound = (err_sum + np.abs(mean) * err_weight) / (weight - err_weight)
    assert (np.abs(result.mean - mean) <= bound * (1 + 1e-9)).all()


# -- shared by the server-guard tests ---------------------------------------------------

#: X25519 public keys of small order (the all-zero point and the point 1).
SMALL_ORDER = [bytes(32), (1).to_bytes(32, "little")]


def fresh_keys() -> tuple[bytes, bytes]:
    """A new (cipher, mask) public-key pair."""
    return (public_bytes(X25519PrivateKey.generate()), public_bytes(X25519PrivateKey.generate()))


def answer(rnd: Round, cid: str) -> Any:
    """Client ``cid``'s honest reply to the server's current request for it."""
    vector, n = rnd.inputs[cid]
    return rnd.clients[cid].handle(rnd.server.request_for(cid), vector=vector, num_examples=n)


def close_masked_input(rnd: Round, before: tuple[str, ...], after: tuple[str, ...]) -> None:
    """Close the masked-input stage: the ``before`` clients drop without an input, the
    rest send theirs, then the ``after`` clients drop (their inputs are in the sum)."""
    server = rnd.server
    for cid in sorted(server.pending()):
        if cid in before:
            server.drop(cid)
            continue
        server.receive(cid, answer(rnd, cid))
    for cid in after:
        server.drop(cid)  # its masked input is in the sum; it cannot reveal shares
    server.advance()
