"""Secure aggregation (SecAgg+): the protocol, its primitives and its state machines.

SecAgg+ (Bell et al., "Secure Single-Server Aggregation with (Poly)Logarithmic
Overhead", CCS 2020) over the masking scheme of Bonawitz et al. ("Practical Secure
Aggregation for Privacy-Preserving Machine Learning", CCS 2017), with the consistency
check of Bonawitz et al.'s actively secure protocol adapted to the sparse graph. The
server state machine is `SecAggServer`, the client half `SecAggClient`; both are pure
objects driven by the messages defined here, so any transport can carry them (the gRPC
server's in `fedloom.server.secure`, the client SDK's in
`fedloom.client_sdk.secure_fit`, the local simulation engine's in
`fedloom.simulations.local_secure`).

This package does no I/O: X25519 + HKDF-SHA256 + ChaCha20-Poly1305 and the commitments
and signed statements (`_crypto`), client certificates and signatures (`_identity`), the
AES-128-CTR mask PRG (`_prg`), Shamir sharing over GF(2**521 - 1) (`_shamir`),
quantization (`_quantize`), the derived, connected neighbour graph (`_graph`), the
configuration (`_config`), the setup (`_setup`), the messages (`_messages`), the state
machines (`_server`, with an attempt's state and stage steps in `_attempt`, its reply
checks in `_server_checks` and its outcome in `_result`; `_client`, with its state in
`_client_state`, its attempt bookkeeping in `_client_attempts` and its checks in
`_client_checks`) and the server's unmasking (`_unmask`).

Threat model (docs/secure-aggregation.md has the table and the argument). The server
is the adversary; it must not learn one honest client's update.

- Authenticated attempts (clients hold certificates of a client CA): secure against a
  server that deviates from the protocol in any way — different survivor sets or models
  to different clients, substituted or replayed keys, withheld shares — colluding with
  at most ``2t - k - 1`` clients (`SecAggConfig.colluding_clients`). Clients sign their
  keys and the survivor set they confirm, check each other's certificates and
  signatures, derive the graph themselves, check shares against their dealers'
  commitments, and reveal shares only under the one survivor set they confirmed, with t
  neighbours' confirmations of it.
- Unauthenticated attempts (no client PKI; servers must opt in): secure against a
  server that follows the protocol, colluding with at most ``t - 1`` clients.
- Not in scope: clients that spoil the sum with malformed inputs (SecAgg hides inputs,
  it does not check them), differences between sums of different attempts or rounds,
  and the privacy of the sum itself (add differential privacy for those).
"""

from fedloom.secagg._client import RoundLedger, SecAggClient
from fedloom.secagg._client_state import DealerAccused, accusation_failure, accused_dealer
from fedloom.secagg._config import SecAggConfig, ceil_log2, dropout_failure_bound
from fedloom.secagg._crypto import (
    MASK_KEY,
    SEALED_SHARE_BYTES,
    SELF_MASK,
    agree,
    commit_self_mask,
    commit_share,
    derive_mask_seed,
    derive_share_key,
    generate_private_key,
    key_statement,
    new_seed,
    open_share,
    private_bytes,
    private_key_from_bytes,
    public_bytes,
    seal_share,
    survivors_statement,
    usable_public_key,
)
from fedloom.secagg._encoding import PROTOCOL_LABEL
from fedloom.secagg._graph import (
    graph_seed,
    is_connected,
    neighbour_graph,
    ring_offsets,
    ring_order,
)
from fedloom.secagg._identity import PeerVerifier, SigningIdentity, VerifiedPeer, certificate_name
from fedloom.secagg._messages import (
    STAGE_OF,
    AdvertisedKeys,
    AdvertiseKeysRequest,
    Confirmation,
    ConsistencyReply,
    ConsistencyRequest,
    EncryptedShare,
    KeyOffer,
    MaskedInputReply,
    MaskedInputRequest,
    RevealedShare,
    SecAggReply,
    SecAggRequest,
    ShareCommitment,
    ShareKeysReply,
    ShareKeysRequest,
    Stage,
    UnmaskReply,
    UnmaskRequest,
)
from fedloom.secagg._prg import MaskExpander, aes_ctr_keystream, expand_mask, split_mask_seed
from fedloom.secagg._quantize import clip_delta, dequantize, flatten, quantize, unflatten
from fedloom.secagg._server import SecAggResult, SecAggServer, SecAggStatus
from fedloom.secagg._setup import RoundId, RoundSetup, config_digest, model_digest
from fedloom.secagg._shamir import PRIME, SHARE_BYTES, reconstruct, split

__all__ = [
    "MASK_KEY",
    "PRIME",
    "PROTOCOL_LABEL",
    "SEALED_SHARE_BYTES",
    "SELF_MASK",
    "SHARE_BYTES",
    "STAGE_OF",
    "AdvertiseKeysRequest",
    "AdvertisedKeys",
    "Confirmation",
    "ConsistencyReply",
    "ConsistencyRequest",
    "DealerAccused",
    "EncryptedShare",
    "KeyOffer",
    "MaskExpander",
    "MaskedInputReply",
    "MaskedInputRequest",
    "PeerVerifier",
    "RevealedShare",
    "RoundId",
    "RoundLedger",
    "RoundSetup",
    "SecAggClient",
    "SecAggConfig",
    "SecAggReply",
    "SecAggRequest",
    "SecAggResult",
    "SecAggServer",
    "SecAggStatus",
    "ShareCommitment",
    "ShareKeysReply",
    "ShareKeysRequest",
    "SigningIdentity",
    "Stage",
    "UnmaskReply",
    "UnmaskRequest",
    "VerifiedPeer",
    "accusation_failure",
    "accused_dealer",
    "aes_ctr_keystream",
    "agree",
    "ceil_log2",
    "certificate_name",
    "clip_delta",
    "commit_self_mask",
    "commit_share",
    "config_digest",
    "dequantize",
    "derive_mask_seed",
    "derive_share_key",
    "dropout_failure_bound",
    "expand_mask",
    "flatten",
    "generate_private_key",
    "graph_seed",
    "is_connected",
    "key_statement",
    "model_digest",
    "neighbour_graph",
    "new_seed",
    "open_share",
    "private_bytes",
    "private_key_from_bytes",
    "public_bytes",
    "quantize",
    "reconstruct",
    "ring_offsets",
    "ring_order",
    "seal_share",
    "split",
    "split_mask_seed",
    "survivors_statement",
    "unflatten",
    "usable_public_key",
]
