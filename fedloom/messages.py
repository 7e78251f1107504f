"""Domain forms of the Fleet protocol's headers (``protos/fedloom/v1/fleet.proto``).

`fedloom.protos.codec` converts these to and from protobuf; nothing else touches the
generated classes. Weights and updates are not part of these headers: they follow as
chunks described by a `PayloadInfo`.
"""

from __future__ import annotations

import dataclasses
import enum

from fedloom.compression import CodecSpec
from fedloom.payload import PayloadInfo
from fedloom.secagg import RoundId, SecAggReply, SecAggRequest
from fedloom.types import Config, Metrics, TaskKind
from fedloom.weights import TensorSpec

#: 2: a secure round's fit config and weights travel with the masked-input stage (the
#: client trains there), not with advertise keys as in 1. 3: the Tasks stream and the
#: Report call (a client reads its tasks from one stream and sends payload-less results
#: in one message; Pull and Push stay). 4: SecAgg+ key offers (a share-keys result offers
#: keys for the next attempt and carries the self-mask commitment; a share-keys task may
#: carry the setup and the client's own keys). 5: SecAgg+ against a malicious server
#: (signed keys; the setup binds identities, a survivor floor and the model and config
#: digests, and drops the graph seed; a share-keys task lists every participant's keys;
#: share commitments; the consistency stage; unmask carries confirmations, not the
#: dropped clients). Compression (docs/compression.md) adds only optional fields to
#: version 5: a peer that knows nothing of them asks for, grants and sends no codec (and
#: no zstd stage).
PROTOCOL_VERSION = 5


class Capability(enum.StrEnum):
    """What a client supports, announced in its Join: a kind of task it accepts (the
    server sends it only tasks of the kinds both sides hold; the values are those of the
    matching `TaskKind`), or a wire feature. The server's reply lists those granted."""

    FIT = TaskKind.FIT.value
    EVALUATE = TaskKind.EVALUATE.value
    SECAGG = TaskKind.SECAGG.value  # secure-aggregation stages (fedloom.secagg)
    #: Small payloads inside their headers (`fedloom.payload.inline_limit`): a task's in
    #: TaskHeader.inline_payload, a result's in ResultHeader.inline_payload through Report.
    INLINE = "inline"


#: The capabilities a server of this version grants: those a client asks for among these.
SERVER_CAPABILITIES: frozenset[Capability] = frozenset(Capability)


@dataclasses.dataclass(frozen=True, slots=True)
class Session:
    """A client's identity and the secret that proves it on every call."""

    client_id: str
    secret: bytes

    def __repr__(self) -> str:  # never log the secret
        return f"Session(client_id={self.client_id!r}, secret=<{len(self.secret)} bytes>)"


@dataclasses.dataclass(frozen=True, slots=True)
class JoinRequest:
    """A client's Join; ``upload_codecs`` / ``download_codecs`` name the codecs it wants
    per direction, most wanted first (empty: none)."""

    protocol_version: int
    capabilities: frozenset[str]
    name: str
    token: str = dataclasses.field(default="", repr=False)
    upload_codecs: tuple[str, ...] = ()
    download_codecs: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class JoinReply:
    """The server's answer to a Join; ``upload_codec`` / ``download_codec`` are the codecs
    granted to the session (None: plain float32), ``upload_zstd`` / ``download_zstd``
    whether the zstd stage may follow them."""

    session: Session
    protocol_version: int
    capabilities: frozenset[str]
    run_id: str
    heartbeat_interval_s: float
    long_poll_s: float
    chunk_size: int
    max_message_bytes: int
    max_model_bytes: int
    upload_codec: CodecSpec | None = None
    download_codec: CodecSpec | None = None
    upload_zstd: bool = False
    download_zstd: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class NoTask:
    retry_after_s: float
    run_finished: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class TaskHeader:
    """A fit, evaluate or secure-aggregation task; the payload `weights` describes follows.

    A `TaskKind.SECAGG` task carries its stage request in `secagg`; only the
    masked-input stage (where the client trains) carries the global weights and the fit
    config, the other stages an empty payload.

    With a `codec` (a fit or evaluate task to a client granted a download codec), the
    payload `weights` describes is the model encoded with it, and `decoded` is the
    model's own layout, which that payload decodes into. A ``weights.wire_bytes``
    other than 0 says that the payload travels zstd-compressed (granted at Join).
    """

    task_id: str
    run_id: str
    round: int
    kind: TaskKind
    config: Config
    deadline_s: float
    weights: PayloadInfo
    secagg: SecAggRequest | None = None
    codec: CodecSpec | None = None
    decoded: tuple[TensorSpec, ...] = ()

    @property
    def model_specs(self) -> tuple[TensorSpec, ...]:
        """The layout of the model this task carries (decoded, when encoded)."""
        return self.decoded if self.codec is not None else self.weights.specs


@dataclasses.dataclass(frozen=True, slots=True)
class ResultHeader:
    """A client's answer to a task; for a fit, the delta described by `update` follows.

    Exactly one of: a fit (`num_examples`, `base_round`, `update`), an evaluation
    (`num_examples`, `loss`), a secure-aggregation stage reply (`secagg`; for the
    masked input a `MaskedInputHeader`, with the masked vector described by `update`),
    or a failure (`failure` holds the client's message). A fit's `codec` (None: plain)
    says how its delta is encoded: `update` then describes the encoded layout; an
    ``update.wire_bytes`` other than 0 says that it travels zstd-compressed.
    """

    session: Session
    task_id: str
    round: int
    kind: TaskKind | None  # None: the client reports a failure
    num_examples: int = 0
    base_round: int = 0
    loss: float = 0.0
    metrics: Metrics = dataclasses.field(default_factory=dict)
    failure: str = ""
    update: PayloadInfo | None = None
    secagg: SecAggReply | MaskedInputHeader | None = None
    codec: CodecSpec | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class MaskedInputHeader:
    """Names a masked-input upload; the vector follows as the result's payload.

    The payload holds exactly one tensor, ``"masked"``: uint32 of the round's
    ``masked_length`` (see `fedloom.secagg.MaskedInputReply`).
    """

    round_id: RoundId
    client_id: str


#: The name of the one tensor of a masked-input payload.
MASKED_TENSOR = "masked"
