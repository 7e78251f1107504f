"""The public parameters of a SecAgg+ round attempt: `RoundId`, `RoundSetup`, and the
digests a setup binds (`config_digest`, `model_digest`).

A setup is sent to every participant; every key derivation, sealed share, commitment
and signature of the attempt is bound to its digest (`RoundSetup.binding`), so two
clients shown different setups (another model, another participant list, another
attempt) cannot pair. Constructors check shapes and raise `MessageRejectedError`.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

from fedloom.errors import ConfigError, MessageRejectedError, RejectReason
from fedloom.secagg._config import SecAggConfig
from fedloom.secagg._encoding import PROTOCOL_LABEL, pack
from fedloom.weights import TensorSpec

PUBLIC_KEY_BYTES = 32
COMMITMENT_BYTES = 32
DIGEST_BYTES = 32
NONCE_BYTES = 12
SEED_BYTES = 32
MAX_ID_LENGTH = 256
#: Masks are AES-CTR keystreams with a 32-bit block counter: 2**32 blocks of 4 words.
MAX_VECTOR_LENGTH = 1 << 34


def invalid(message: str) -> MessageRejectedError:
    return MessageRejectedError(RejectReason.INVALID, message)


def check_id(value: Any, what: str) -> None:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ID_LENGTH:
        raise invalid(f"{what} must be a client id of 1..{MAX_ID_LENGTH} characters")


def check_bytes(value: Any, length: int, what: str) -> None:
    if not isinstance(value, bytes) or len(value) != length:
        raise invalid(f"{what} must be {length} bytes")


def check_int(value: Any, what: str, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise invalid(f"{what} must be an integer >= {minimum}, got {value!r}")


def check_ids(values: Any, what: str) -> None:
    if not isinstance(values, tuple):
        raise invalid(f"{what} must be a tuple of client ids")
    for value in values:
        check_id(value, what)
    if list(values) != sorted(set(values)):
        raise invalid(f"{what} must be sorted and unique")


def config_digest(config: Mapping[str, Any]) -> bytes:
    """SHA-256 of a fit config in a canonical encoding (keys sorted, values typed).

    Bound into the round's setup, so every participant trains with the same config.
    """
    parts: list[str | bytes | int | float] = [len(config)]
    for key in sorted(config):
        value = config[key]
        # by the wire's types: a subclass (an IntEnum, numpy's float64) arrives as its base
        plain: str | bytes | int | float
        if isinstance(value, bool):  # before int: bool is an int subclass
            kind, plain = "bool", int(value)
        elif isinstance(value, int):
            kind, plain = "int", int(value)
            if not -(1 << 63) <= plain < 1 << 63:
                raise ValueError(f"fit config value {key!r} does not fit in 64 bits")
        elif isinstance(value, float):
            kind, plain = "float", float(value)
        elif isinstance(value, str):
            kind, plain = "str", str(value)
        elif isinstance(value, bytes):
            kind, plain = "bytes", bytes(value)
        else:
            raise TypeError(f"fit config value {key!r} is a {type(value).__name__}")
        parts += [key, kind, plain]
    return hashlib.sha256(PROTOCOL_LABEL + b"fit-config" + pack(*parts)).digest()


def model_digest(specs: Sequence[TensorSpec], payload_sha256: bytes) -> bytes:
    """SHA-256 binding a model's layout (names, dtypes, shapes) and its bytes' SHA-256.

    Bound into the round's setup, so every participant trains on the same global model:
    a server that sends one client another model makes that client's setup differ from
    its neighbours', and every key, share and signature of the attempt with it.
    """
    parts: list[str | bytes | int] = [len(specs)]
    for spec in specs:
        parts += [spec.name, spec.dtype, len(spec.shape), *spec.shape]
    parts.append(payload_sha256)
    return hashlib.sha256(PROTOCOL_LABEL + b"model" + pack(*parts)).digest()


@dataclasses.dataclass(frozen=True, slots=True)
class RoundId:
    """Names one round attempt: a restarted round gets a new ``attempt`` (and new keys)."""

    run_id: str
    server_round: int
    attempt: int

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str) or not 0 < len(self.run_id) <= MAX_ID_LENGTH:
            raise invalid(f"run_id must be a string of 1..{MAX_ID_LENGTH} characters")
        check_int(self.server_round, "server_round")
        check_int(self.attempt, "attempt")

    def encode(self) -> bytes:
        return pack(self.run_id, self.server_round, self.attempt)


@dataclasses.dataclass(frozen=True, slots=True)
class RoundSetup:
    """The public parameters of one round attempt, sent to every participant.

    ``participants`` is sorted; a client's Shamir x-coordinate is its position plus one,
    and ``identities`` names each participant's identity in the same order (the name its
    client certificate carries, in an ``authenticated`` attempt, where no identity may
    be seated twice). ``vector_length`` is the length of the float vector a client
    contributes; the masked vector has one more element (the weight).
    ``min_survivors``: clients refuse to unmask a sum over fewer survivors.
    ``model_digest`` / ``config_digest`` (`model_digest`, `config_digest`) bind the
    global model and fit config the masked-input stage delivers. The neighbour graph is
    not part of the setup: every party derives it from the setup and the keys every
    participant advertised (`fedloom.secagg.graph_seed`). Build one with
    `RoundSetup.create`.
    """

    round_id: RoundId
    participants: tuple[str, ...]
    identities: tuple[str, ...]
    neighbours: int
    threshold: int
    clip_range: float
    bits: int
    max_weight: float
    vector_length: int
    min_survivors: int
    model_digest: bytes
    config_digest: bytes
    authenticated: bool
    digest: bytes = dataclasses.field(init=False, repr=False, compare=False)
    #: ``pack(round_id.encode(), digest)``: the prefix every derivation of the attempt
    #: binds (computed once; `pack` of more fields is this plus their encodings)
    binding: bytes = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.round_id, RoundId):
            raise invalid("round_id must be a RoundId")
        check_ids(self.participants, "participants")
        if not isinstance(self.identities, tuple) or len(self.identities) != len(
                self.participants):
            raise invalid("identities must name every participant, in participant order")
        for name in self.identities:
            check_id(name, "identity")
        if not isinstance(self.authenticated, bool):
            raise invalid("authenticated must be a bool")
        if self.authenticated and len(set(self.identities)) != len(self.identities):
            raise invalid("an authenticated round seats every identity once (two "
                           "participants claim one certificate's name)")
        check_int(self.vector_length, "vector_length", minimum=1)
        if self.vector_length + 1 > MAX_VECTOR_LENGTH:
            raise invalid(f"vector_length must be below {MAX_VECTOR_LENGTH}")
        check_bytes(self.model_digest, DIGEST_BYTES, "model_digest")
        check_bytes(self.config_digest, DIGEST_BYTES, "config_digest")
        for name in ("clip_range", "max_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, float) or not math.isfinite(value):
                raise invalid(f"{name} must be a finite float")
        check_int(self.min_survivors, "min_survivors")
        try:
            self.config().check_round_size(len(self.participants))
        except ConfigError as exc:
            raise invalid(f"round parameters refused: {exc}") from exc
        if not self.threshold + 1 <= self.min_survivors <= len(self.participants):
            raise invalid(f"min_survivors ({self.min_survivors}) must be between threshold + 1 "
                           f"({self.threshold + 1}) and the number of participants "
                           f"({len(self.participants)})")
        object.__setattr__(self, "digest", hashlib.sha256(self._encode()).digest())
        object.__setattr__(self, "binding", pack(self.round_id.encode(), self.digest))

    @classmethod
    def create(
        cls,
        config: SecAggConfig,
        round_id: RoundId,
        participants: Sequence[str] | frozenset[str],
        vector_length: int,
        *,
        model_digest: bytes,
        config_digest: bytes,
        identities: Mapping[str, str] | None = None,
        authenticated: bool = False,
    ) -> RoundSetup:
        """Set up a round attempt from the server's configuration.

        ``identities`` maps each participant to its identity (its certificate's name in
        an authenticated round); by default a participant's id is its identity.
        Raises `ConfigError` when the round is larger than ``max_participants`` or too
        small for the threshold or the survivor floor.
        """
        ids = tuple(sorted(set(participants)))
        config.check_round_size(len(ids))
        floor = config.survivor_floor
        if len(ids) < floor:
            raise ConfigError("secure_aggregation.min_survivors",
                              f"a round of {len(ids)} clients cannot reach the survivor floor "
                              f"of {floor}: sample more clients or lower min_survivors")
        names = identities or {}
        return cls(
            round_id=round_id,
            participants=ids,
            identities=tuple(names.get(pid, pid) for pid in ids),
            neighbours=config.neighbours,
            threshold=config.threshold,
            clip_range=float(config.clip_range),
            bits=config.bits,
            max_weight=float(config.max_weight),
            vector_length=vector_length,
            min_survivors=floor,
            model_digest=model_digest,
            config_digest=config_digest,
            authenticated=authenticated,
        )

    def config(self) -> SecAggConfig:
        """The protocol parameters as a (validated) `SecAggConfig`."""
        return SecAggConfig(
            enabled=True,
            neighbours=self.neighbours,
            threshold=self.threshold,
            clip_range=self.clip_range,
            bits=self.bits,
            max_weight=self.max_weight,
            max_participants=max(2, len(self.participants)),
            colluding_clients=0,  # an assumption of the deployment, not a round parameter
        )

    @property
    def masked_length(self) -> int:
        """Length of a masked vector: the weighted delta plus the weight."""
        return self.vector_length + 1

    def index(self, client_id: str) -> int:
        """The client's 0-based position in ``participants`` (`KeyError` if absent)."""
        at = bisect.bisect_left(self.participants, client_id)  # the tuple is sorted
        if at == len(self.participants) or self.participants[at] != client_id:
            raise KeyError(client_id)
        return at

    def x_coordinate(self, client_id: str) -> int:
        """The client's Shamir x-coordinate (its 1-based position in ``participants``)."""
        return self.index(client_id) + 1

    def identity_of(self, client_id: str) -> str:
        """The identity the setup seats as ``client_id``."""
        return self.identities[self.index(client_id)]

    def _encode(self) -> bytes:
        return PROTOCOL_LABEL + b"setup" + pack(
            self.round_id.encode(),
            len(self.participants),
            *self.participants,
            *self.identities,
            self.neighbours,
            self.threshold,
            self.clip_range,
            self.bits,
            self.max_weight,
            self.vector_length,
            self.min_survivors,
            self.model_digest,
            self.config_digest,
            int(self.authenticated),
        )
