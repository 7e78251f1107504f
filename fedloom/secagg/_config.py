"""`SecAggConfig`: the ``[secure_aggregation]`` settings, validated with their reasons.

.. code-block:: toml

    [secure_aggregation]
    enabled = true
    neighbours = 10        # k: OTHER clients each client pairs with (itself not counted)
    threshold = 6          # t: shares that reconstruct a secret; k/2 < t <= k
    clip_range = 8.0       # each delta coordinate is clipped to [-clip_range, clip_range]
    bits = 22              # quantization levels 2**bits - 1 per coordinate
    max_weight = 10000.0   # num_examples / max_weight in (0, 1] is the masked weight
    max_participants = 1024  # n: most clients summed in one round
    stage_timeout_s = 60.0   # deadline of each stage but masked input (which trains)
    min_survivors = 0        # clients refuse to unmask a sum of fewer (0: threshold + 1)
    colluding_clients = 1    # c: clients assumed to collude with the server
    max_attempts = 3         # attempts per round (a failed attempt is retried)
    allow_unauthenticated = false  # run without a client PKI (honest-but-curious only)

Why each rule (Bonawitz et al., CCS 2017; Bell et al., CCS 2020):

- ``neighbours`` k counts the other clients a client shares its secrets with and masks
  against; the client itself holds no share of its own secrets. k must be even so that
  a k-regular neighbour graph (a Harary graph) exists for every number of participants.
- ``threshold`` t > k/2: the server must not gather t shares of a client's self-mask
  seed from one half of its neighbours (by calling it a survivor) and t shares of its
  mask key from the other half (by calling it dropped); each neighbour answers one
  unmask request, so two disjoint groups of t would need 2t > k neighbours.
- t <= k: otherwise no set of neighbours can ever reconstruct, and no dropout (or even
  a full round) can be unmasked.
- ``bits + ceil(log2 max_participants) <= 32``: each client's quantized coordinate is
  below 2**bits, so the sum of n of them stays below 2**32 and the modular sum never
  wraps (a wrapped sum would decode to garbage). A server samples at most
  ``max_participants`` clients into one secure round.

- ``colluding_clients`` c, the clients assumed to collude with the server, must satisfy
  ``c <= 2t - k - 1`` (and so ``c <= t - 1``). Against a server that follows the
  protocol, t - 1 colluders among a client's neighbours hold fewer than t shares of
  either of its secrets. Against a server that lies about who survived, each honest
  client confirms one survivor set per attempt and reveals only under a set that at
  least t of its neighbours confirmed; unmasking one client would need some honest
  neighbour to have t neighbours confirming one set and t others treating it as
  dropped, that is ``2t - c <= k``. The argument is written out in
  docs/secure-aggregation.md; it holds for every neighbour graph, so it does not rest
  on the graph's randomness. ``t = k/2 + 1`` tolerates one colluder; raise t for more
  (k = 10, t = 8 tolerates five), at the cost of dropouts (a client's secrets survive
  while no more than k - t of its neighbours vanish).
- ``min_survivors``: clients refuse to unmask a sum over fewer survivors; at least
  t + 1 (every survivor needs t surviving neighbours), which is the default (0).
- ``max_attempts``: a secure round whose attempt fails (too few clients left, a client
  that vanished before confirming) is retried with fresh keys and without the clients
  that failed, while the round's time lasts; a client takes part in at most this many
  attempts of one round (each attempt shows the server a sum over its survivors).
- ``allow_unauthenticated``: secure aggregation needs mutual TLS (clients sign their
  keys and confirmations with their certificates, and check each other's against the
  client CA); without a client PKI the protocol is secure against an honest-but-curious
  server only, and the server refuses to run it unless this is set (and warns).

Inside a server's configuration (`check_server`), a secure round also needs
``min_fit_clients >= max(threshold + 1, min_survivors)`` and ``min_fit_clients <=
max_participants``; over-selection is refused (a secure round tolerates dropouts
instead of cancelling stragglers), and so are strategies that need the individual
updates (checked where the strategy is built, `fedloom.server`).
"""

from __future__ import annotations

import dataclasses
import math

from fedloom.errors import ConfigError, SecureAggregationError
from fedloom.settings import described

SECTION = "secure_aggregation"


def _fail(setting: str, problem: str) -> ConfigError:
    return ConfigError(f"{SECTION}.{setting}", problem)


def ceil_log2(n: int) -> int:
    """``ceil(log2 n)`` for ``n >= 1`` (exact, integer arithmetic)."""
    return (n - 1).bit_length()


def dropout_failure_bound(n: int, neighbours: int, threshold: int, dropout: float) -> float:
    """Union bound on the chance that a round of ``n`` clients cannot be unmasked.

    A round fails when some survivor (or dropped client whose masks must be removed)
    has fewer than ``threshold`` neighbours left to reveal its shares, i.e. more than
    ``d - threshold`` of its ``d = min(neighbours, n - 1)`` neighbours vanish. With each
    client gone independently with probability ``dropout`` this is at most
    ``n * P(Binomial(d, dropout) > d - threshold)``. Use it to choose k and t (Bell et
    al. 2020 pick k of order log n for this reason). With 20% of clients vanishing
    between their masked input and the unmask stage: k = 10, t = 6 gives a bound of 1.0
    at n = 50 (such rounds usually fail), k = 20, t = 11 gives 0.13 and k = 30, t = 16
    gives 0.012; at 10% dropout k = 10, t = 6 gives 0.08. Dropouts before the shares
    are exchanged cost less: those clients are left out of the round.
    """
    d = min(neighbours, n - 1)
    if threshold > d:
        return 1.0  # too few neighbours to reconstruct anything
    tail = sum(math.comb(d, j) * dropout**j * (1 - dropout) ** (d - j)
               for j in range(d - threshold + 1, d + 1))
    return min(1.0, n * tail)


@dataclasses.dataclass(frozen=True)
class SecAggConfig:
    """Secure-aggregation settings (SecAgg+, Bell et al. 2020).

    Attributes:
        enabled: run the fit round under SecAgg+ (the server sees only the sum).
        neighbours: k, the number of other clients each client pairs with; even.
        threshold: t, the number of neighbours' shares that reconstruct a secret.
        clip_range: every delta coordinate is clipped to ``[-clip_range, clip_range]``
            on the client before quantization (this is also the norm bound).
        bits: quantization precision; one quantum is ``2 * clip_range / (2**bits - 1)``.
        max_weight: a client's weight is ``num_examples / max_weight``; a client with
            more examples than this refuses to take part (it cannot claim a weight > 1).
            Precision scales with the weight, so set it near the largest client.
        max_participants: n, the most clients one round may sum.
        stage_timeout_s: seconds the server waits for the replies of the advertise-keys,
            share-keys, consistency and unmask stages; the masked-input stage includes
            the model's download and local training and waits the server's
            ``round_timeout_s``. Not a protocol parameter: clients do not check it.
        min_survivors: the smallest survivor set clients agree to unmask; 0 means
            ``threshold + 1`` (`survivor_floor`).
        colluding_clients: how many clients may collude with the server; checked
            against k and t (``c <= 2t - k - 1``).
        max_attempts: attempts one round may take (server), and that a client takes
            part in (client).
        allow_unauthenticated: let a server without mutual TLS run secure rounds
            (secure against an honest-but-curious server only).
    """

    enabled: bool = described(
        False,
        "run fit rounds under SecAgg+: the server learns only the sum of the updates")
    neighbours: int = described(
        10,
        "k: other clients each client masks against and shares secrets with (even)")
    threshold: int = described(6, "t: neighbours' shares that reconstruct a secret; k/2 < t <= k")
    clip_range: float = described(
        8.0,
        "each delta coordinate is clipped to [-clip_range, clip_range] on the client")
    bits: int = described(
        22,
        "quantization bits per coordinate; bits + ceil(log2 max_participants) <= 32")
    max_weight: float = described(
        10_000.0,
        "num_examples of the largest client (weights are num_examples / max_weight)")
    max_participants: int = described(1024, "most clients summed in one secure round")
    stage_timeout_s: float = described(
        60.0,
        "seconds each stage but masked input (which trains) waits for replies")
    min_survivors: int = described(
        0,
        "clients refuse to unmask a sum over fewer survivors (0: threshold + 1)")
    colluding_clients: int = described(
        1,
        "c: clients assumed to collude with the server; c <= 2t - k - 1")
    max_attempts: int = described(
        3,
        "attempts per round: a failed attempt is retried without its dropouts")
    allow_unauthenticated: bool = described(
        False,
        "run secure rounds without mutual TLS (protects against an honest-but-curious"
        " server only; warned)")

    def __post_init__(self) -> None:
        k, t = self.neighbours, self.threshold
        for name in ("enabled", "allow_unauthenticated"):
            if not isinstance(getattr(self, name), bool):
                raise _fail(name, f"must be true or false, got {getattr(self, name)!r}")
        for name in ("neighbours", "threshold", "bits", "max_participants", "min_survivors",
                     "colluding_clients", "max_attempts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise _fail(name, f"must be an integer, got {value!r}")
        if k < 2 or k % 2:
            raise _fail(
                "neighbours",
                f"must be an even number >= 2 (got {k}): it counts the other clients each "
                "client pairs with (not itself), and a k-regular neighbour graph exists for "
                "every number of clients only when k is even",
            )
        if not 2 * t > k:
            raise _fail(
                "threshold",
                f"must exceed neighbours/2 = {k / 2} (got {t}; neighbours counts the other "
                "clients each client pairs with, not the client itself): otherwise the server "
                "could collect the self-mask shares of a client from half of its neighbours "
                "and its mask-key shares from the other half, and unmask its input; use at least "
                f"{k // 2 + 1}",
            )
        if t > k:
            raise _fail(
                "threshold",
                f"cannot exceed neighbours ({k}) (got {t}): a client's secret is split among "
                "its k neighbours (the client itself holds no share), so more than k shares "
                "can never be gathered",
            )
        for name in ("clip_range", "max_weight", "stage_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise _fail(name, f"must be a number, got {value!r}")
            if not (math.isfinite(value) and value > 0):
                raise _fail(name, f"must be a positive finite number, got {value!r}")
        if not 1 <= self.bits <= 31:
            raise _fail("bits", f"must be in 1..31, got {self.bits}")
        if self.max_participants < 2:
            raise _fail("max_participants", f"must be at least 2, got {self.max_participants}")
        need = self.bits + ceil_log2(self.max_participants)
        if need > 32:
            raise _fail(
                "bits",
                f"bits + ceil(log2 max_participants) = {self.bits} + "
                f"{ceil_log2(self.max_participants)} = {need} exceeds 32: the sum of "
                f"{self.max_participants} quantized values could wrap modulo 2**32; lower bits "
                f"to {32 - ceil_log2(self.max_participants)} or max_participants to "
                f"{1 << (32 - self.bits)}",
            )
        if self.min_survivors and not t + 1 <= self.min_survivors <= self.max_participants:
            raise _fail("min_survivors",
                        f"must be 0 (threshold + 1) or between threshold + 1 = {t + 1} and "
                        f"max_participants = {self.max_participants}, got {self.min_survivors}")
        limit = 2 * t - k - 1
        if self.colluding_clients < 0 or self.colluding_clients > limit:
            raise _fail(
                "colluding_clients",
                f"is {self.colluding_clients}, but neighbours {k} and threshold {t} protect each "
                f"client against at most 2t - k - 1 = {limit} clients colluding with a server "
                "that deviates from the protocol (docs/secure-aggregation.md, threat model): "
                f"raise threshold to {(k + self.colluding_clients) // 2 + 1} or assume fewer "
                "colluders",
            )
        if not 1 <= self.max_attempts <= 16:
            raise _fail("max_attempts", f"must be in 1..16, got {self.max_attempts}")

    @property
    def survivor_floor(self) -> int:
        """The smallest survivor set a round may unmask: ``max(t + 1, min_survivors)``."""
        return max(self.threshold + 1, self.min_survivors)

    def check_server(self, min_fit_clients: int, over_selection: float = 1.0, *,
                     authenticated: bool = True) -> None:
        """Refuse server settings that cannot run secure rounds (when ``enabled``).

        ``authenticated``: the server runs mutual TLS, so its clients hold certificates
        of the client CA (without it, ``allow_unauthenticated`` must be set).
        """
        if not self.enabled:
            return
        if not authenticated and not self.allow_unauthenticated:
            raise _fail(
                "allow_unauthenticated",
                "is false, but this server has no client PKI (mutual TLS: tls.client_ca): "
                "clients sign their keys and survivor confirmations with their certificates "
                "and check each other's, which is what protects them from a server that "
                "substitutes keys or lies about who survived. Serve mutual TLS, or set "
                "secure_aggregation.allow_unauthenticated = true to run the protocol secure "
                "against an honest-but-curious server only",
            )
        need = self.survivor_floor
        if min_fit_clients < need:
            raise ConfigError(
                "min_fit_clients",
                f"is {min_fit_clients}, but a secure round needs at least "
                f"max(threshold + 1, min_survivors) = {need} clients (each survivor's masks are "
                f"removed with the shares of {self.threshold} surviving neighbours, and "
                "clients refuse to unmask fewer than min_survivors): raise min_fit_clients "
                f"(and min_clients) to {need}, or lower secure_aggregation.neighbours and "
                "threshold together (k/2 < t <= k; docs/secure-aggregation.md has a table "
                "for federations of 3 to 10 sites)",
            )
        if min_fit_clients > self.max_participants:
            raise _fail(
                "max_participants",
                f"({self.max_participants}) is below min_fit_clients ({min_fit_clients}): a "
                "secure round sums at most max_participants clients",
            )
        if over_selection != 1.0:
            raise ConfigError(
                "over_selection",
                f"is {over_selection}, but over-selection cancels the fit tasks of slow "
                "clients, which a secure round cannot do once keys are shared (it tolerates "
                "dropouts down to the threshold instead): set over_selection = 1 with "
                "secure_aggregation.enabled",
            )

    @property
    def levels(self) -> int:
        """The largest quantized value of one coordinate, ``2**bits - 1``."""
        return (1 << self.bits) - 1

    @property
    def quantum(self) -> float:
        """One quantization step of a (weighted) delta coordinate."""
        return 2.0 * self.clip_range / self.levels

    def check_round_size(self, n: int) -> None:
        """Refuse a round that would sum more than ``max_participants`` clients.

        Also refuses rounds too small to finish: every survivor needs ``threshold``
        surviving neighbours, so at least ``threshold + 1`` clients must take part.
        """
        if n > self.max_participants:
            raise _fail(
                "max_participants",
                f"a round of {n} clients exceeds max_participants ({self.max_participants}); "
                "sample fewer clients per round or raise max_participants (and lower bits)",
            )
        if n < self.threshold + 1:
            raise _fail(
                "threshold",
                f"a round of {n} clients cannot finish with threshold {self.threshold}: each "
                f"client needs {self.threshold} surviving neighbours, so sample at least "
                f"{self.threshold + 1} clients per round",
            )

    def weight_of(self, num_examples: int) -> float:
        """The masked weight ``num_examples / max_weight``, refused outside (0, 1]."""
        if isinstance(num_examples, bool) or not isinstance(num_examples, int):
            raise SecureAggregationError(f"num_examples must be an int, got {num_examples!r}")
        if num_examples <= 0:
            raise SecureAggregationError(f"num_examples must be positive, got {num_examples}")
        if num_examples > self.max_weight:
            raise SecureAggregationError(
                f"num_examples ({num_examples}) exceeds secure_aggregation.max_weight "
                f"({self.max_weight}): a weight above 1 cannot be masked; raise max_weight "
                "on the server"
            )
        return num_examples / self.max_weight
