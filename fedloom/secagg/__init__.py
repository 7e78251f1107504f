"""Secure aggregation (SecAgg+): the pure primitives and the stage definitions.

SecAgg+ (Bell et al., "Secure Single-Server Aggregation with (Poly)Logarithmic
Overhead", CCS 2020) over the masking scheme of Bonawitz et al. ("Practical Secure
Aggregation for Privacy-Preserving Machine Learning", CCS 2017). The server state
machine is `SecAggServer`, the client half `SecAggClient`; both are pure objects driven
by the messages defined here, so any transport can carry them (the gRPC server's in
`fedloom.server.secure`, the client SDK's in `fedloom.client_sdk.secure_fit`, the local
simulation engine's in `fedloom.simulations.local_secure`).

This package holds no state machine and does no I/O: X25519 + HKDF-SHA256 +
ChaCha20-Poly1305 (`_crypto`), the AES-128-CTR mask PRG (`_prg`), Shamir sharing over
GF(2**521 - 1) (`_shamir`), quantization (`_quantize`), the neighbour graph (`_graph`),
the configuration (`_config`) and the messages (`_messages`).

Threat model (what it protects, and against whom):

- in scope: an honest-but-curious server (it follows the protocol but reads
  everything it sees) and up to t - 1 colluding clients, in particular t - 1 of one
  client's neighbours, together with the server. They learn nothing about one client's
  input beyond the sum over the survivors (Bonawitz et al., Theorem 6.3; Bell et al.,
  Theorem 4.7 for the neighbour graph);
- the clients also defend themselves against a server that deviates in the ways the
  unmask stage allows: a client answers one unmask request per round attempt, refuses
  overlapping survivor/dropped lists, ids that are not its neighbours and fewer than t
  survivors, and never reveals both shares of one neighbour;
- out of scope: a server that substitutes the public keys it relays (a man in the
  middle between clients). Advertised keys are NOT signed with client identity keys in
  this version; signatures would need identity keys that clients can check without
  trusting the server (a PKI or pinned keys), which fedloom does not have yet. Also out
  of scope: clients that send malformed masked inputs to spoil the sum (SecAgg hides
  inputs, it does not check them), and the privacy of the sum itself (add differential
  privacy for that).
"""

from fedloom.secagg._client import SecAggClient
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
    RoundId,
    RoundSetup,
    SecAggReply,
    SecAggRequest,
    ShareCommitment,
    ShareKeysReply,
    ShareKeysRequest,
    Stage,
    UnmaskReply,
    UnmaskRequest,
    config_digest,
    model_digest,
)
from fedloom.secagg._prg import MaskExpander, aes_ctr_keystream, expand_mask, split_mask_seed
from fedloom.secagg._quantize import clip_delta, dequantize, flatten, quantize, unflatten
from fedloom.secagg._server import SecAggResult, SecAggServer, SecAggStatus
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
    "EncryptedShare",
    "KeyOffer",
    "MaskExpander",
    "MaskedInputReply",
    "MaskedInputRequest",
    "PeerVerifier",
    "RevealedShare",
    "RoundId",
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
