"""Who may join: client identities from mutual TLS and tokens, and the allow-list.

The servicer calls `Authenticator.identify` in ``Join``, before the coordinator sees
the request; the identity it returns becomes the session's client name, and the
coordinator keeps one session per identity. Later calls prove the session with its
secret (see `fedloom.server.registry`).

Sources of identity (``ServerConfig``):

- mutual TLS (``tls.client_ca``): the TLS handshake already refused any certificate
  not signed by the client CA; the identity is the certificate's CN (or, without one,
  its first subjectAltName), read from the gRPC auth context;
- tokens (``auth.tokens_file``): the client sends ``<name>.<secret>``; the server keeps
  only a hash and compares in constant time (`fedloom.tokens`);
- both: a client must present both, naming the same identity (a stolen key or a
  stolen token alone is not enough);
- neither (``auth.anonymous``, or a plaintext test server): no identity; the client's
  self-chosen name is a label only.

Failures: no or unknown credentials -> ``UNKNOWN_CLIENT`` (UNAUTHENTICATED); a known
identity outside ``auth.allow``, or a client joining under another name than its
credentials prove -> ``FORBIDDEN`` (PERMISSION_DENIED). Tokens and keys are never logged.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fedloom.config import ServerConfig
from fedloom.errors import ConfigError, MessageRejectedError, RejectReason
from fedloom.tokens import TokenStore

log = logging.getLogger("fedloom.server")


def _first(values: Sequence[bytes] | None) -> str | None:
    if not values:
        return None
    try:
        text = values[0].decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text or None


def certificate_identity(auth_context: Mapping[str, Sequence[bytes]]) -> str | None:
    """The client identity in a gRPC auth context: its certificate's CN, else first SAN."""
    if _first(auth_context.get("transport_security_type")) != "ssl":
        return None
    return _first(auth_context.get("x509_common_name")) or _first(
        auth_context.get("x509_subject_alternative_name")
    )


def _unauthenticated(message: str) -> MessageRejectedError:
    return MessageRejectedError(RejectReason.UNKNOWN_CLIENT, message)


def _forbidden(message: str) -> MessageRejectedError:
    return MessageRejectedError(RejectReason.FORBIDDEN, message)


class Authenticator:
    """Checks a joining client's credentials and the allow-list.

    Args:
        mutual_tls: clients present certificates (their CN is the identity).
        tokens: the tokens file, or None when tokens are not used.
        allow: identities admitted (empty: every authenticated identity).
    """

    def __init__(
        self,
        *,
        mutual_tls: bool = False,
        tokens: TokenStore | None = None,
        allow: Sequence[str] = (),
    ) -> None:
        self.mutual_tls = mutual_tls
        self.tokens = tokens
        self.allow = frozenset(allow)

    @classmethod
    def from_config(cls, config: ServerConfig) -> Authenticator:
        tokens = TokenStore.load(config.auth.tokens_file) if config.auth.tokens_file else None
        auth = cls(
            mutual_tls=bool(config.tls.client_ca), tokens=tokens, allow=config.auth.allow
        )
        if tokens is not None and not tokens.names():
            log.warning("the tokens file %s holds no tokens: no client can join", tokens.path)
        if tokens is not None and config.insecure:
            log.warning("tokens travel in plaintext (--insecure): anyone on the path can copy them")
        if auth.allow and tokens is not None:  # with mutual TLS too: a token is required
            unknown = sorted(auth.allow - set(tokens.names()))
            if unknown:
                log.warning("auth.allow names clients without a token: %s", ", ".join(unknown))
        return auth

    @property
    def requires_identity(self) -> bool:
        return self.mutual_tls or self.tokens is not None

    def identify(self, name: str, token: str, auth_context: Mapping[str, Any]) -> str | None:
        """The identity of a joining client (None on an anonymous server).

        Raises:
            MessageRejectedError: UNKNOWN_CLIENT without valid credentials; FORBIDDEN
                for an identity outside the allow-list or a name that is not its own.
        """
        if not self.requires_identity:
            return None
        identity = self._certificate(auth_context) if self.mutual_tls else None
        if self.tokens is not None:
            proven = self._token(token)
            if identity is not None and proven != identity:
                raise _forbidden(
                    f"the token names {proven!r} but the client certificate names "
                    f"{identity!r}; use the token issued to this certificate's name"
                )
            identity = proven
        assert identity is not None
        if name and name != identity:
            raise _forbidden(
                f"joining as {name[:64]!r}, but the credentials are those of {identity!r}; "
                "join under that name (or leave the name empty)"
            )
        if self.allow and identity not in self.allow:
            raise _forbidden(f"client {identity!r} is not on this server's allow-list")
        return identity

    @staticmethod
    def _certificate(auth_context: Mapping[str, Any]) -> str:
        identity = certificate_identity(auth_context)
        if identity is None:
            raise _unauthenticated(
                "this server requires a client certificate with a CN (mutual TLS)"
            )
        return identity

    def _token(self, token: str) -> str:
        assert self.tokens is not None
        if not token:
            raise _unauthenticated("this server requires a token: pass token=... (--token)")
        try:
            self.tokens.refresh()
        except ConfigError as exc:  # fail closed, and tell the operator why
            log.error("refusing joins: %s", exc)
            raise _unauthenticated("the server cannot read its tokens file") from exc
        identity = self.tokens.verify(token)
        if identity is None:
            raise _unauthenticated(
                "unknown or revoked token (ask the operator for a new one: "
                "`fedloom tokens add NAME`)"
            )
        return identity
