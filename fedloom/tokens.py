"""Per-client tokens: the server keeps only their hashes.

A token is ``<name>.<secret>``: the client's name (its identity) and 32 random bytes
(URL-safe base64). ``fedloom tokens add NAME`` prints a new token once and stores

.. code-block:: toml

    [tokens]
    "site-1" = "sha256:9f86d0..."

in the tokens file (mode 0600); the token itself is stored nowhere. A joining client
sends its token; the server finds the entry by the name, hashes the token and compares
the hashes with `hmac.compare_digest` (constant time).

Why SHA-256 and not a slow password hash (scrypt, Argon2): the secret is 256 random
bits, not a human password, so there is nothing to brute-force, and a slow hash would
hand anyone who can reach the port a cheap way to burn the server's CPU with Joins
(GitHub hashes its machine-generated tokens the same way). The hash is
domain-separated (``fedloom-token-v1``) so a digest is useless anywhere else.

Removing a name revokes its token for new Joins; the server notices the file changed
(its inode, modification time or size) at the next Join, so no restart is needed.
Sessions already joined run on until they end.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import tomllib
from pathlib import Path

from fedloom.certs import check_client_name
from fedloom.errors import ConfigError

_DOMAIN = b"fedloom-token-v1\0"
_SCHEME = "sha256:"
_HEADER = (
    "# fedloom client tokens: name = SHA-256 of the token (the tokens are not stored).\n"
    "# Managed with `fedloom tokens add|remove|list`; keep this file private.\n"
)
MAX_TOKEN_CHARS = 1024


def hash_token(token: str) -> str:
    """The stored form of ``token``."""
    return _SCHEME + hashlib.sha256(_DOMAIN + token.encode("utf-8")).hexdigest()


def new_token(name: str) -> str:
    """A fresh token for the client ``name``."""
    return f"{check_client_name(name)}.{secrets.token_urlsafe(32)}"


def token_name(token: str) -> str:
    """The name a token claims (before it is verified); "" when it is malformed."""
    name, sep, secret = token.rpartition(".")
    return name if sep and name and secret else ""


class TokenStore:
    """The tokens file: read, verified against, and edited atomically.

    Args:
        path: the TOML file (it need not exist until a token is added).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._hashes: dict[str, str] = {}
        self._stamp: tuple[int, int, int] | None = None

    @classmethod
    def load(cls, path: str | Path, setting: str = "auth.tokens_file") -> TokenStore:
        """Open an existing tokens file, or raise `ConfigError` naming ``setting``."""
        store = cls(path)
        if not store.path.is_file():
            raise ConfigError(
                setting, f"{str(path)!r} not found (create it with `fedloom tokens add NAME`)"
            )
        store.refresh(setting)
        return store

    def _read_stamp(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)  # edits replace the file

    def refresh(self, setting: str = "auth.tokens_file") -> None:
        """Re-read the file if it changed since the last read."""
        stamp = self._read_stamp()
        if stamp is not None and stamp == self._stamp:
            return
        hashes: dict[str, str] = {}
        if stamp is not None:
            try:
                data = tomllib.loads(self.path.read_text("utf-8"))
            except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
                raise ConfigError(setting, f"cannot read {self.path}: {exc}") from exc
            table = data.get("tokens", {})
            if not isinstance(table, dict):
                raise ConfigError(setting, f"{self.path}: [tokens] must be a table")
            for name, digest in table.items():
                if not (isinstance(digest, str) and digest.startswith(_SCHEME)):
                    raise ConfigError(
                        setting, f"{self.path}: the entry for {name!r} is not a sha256: hash"
                    )
                hashes[name] = digest
        self._hashes, self._stamp = hashes, stamp

    def names(self) -> list[str]:
        return sorted(self._hashes)

    def __contains__(self, name: str) -> bool:
        return name in self._hashes

    def verify(self, token: str) -> str | None:
        """The name ``token`` proves, or None (unknown name or wrong secret)."""
        if not token or len(token) > MAX_TOKEN_CHARS:
            return None
        name = token_name(token)
        stored = self._hashes.get(name)
        # Hash and compare even for an unknown name, so timing tells nothing either way.
        candidate = hash_token(token)
        ok = hmac.compare_digest(stored or _SCHEME + "0" * 64, candidate)
        return name if stored is not None and ok else None

    # -- editing (``fedloom tokens``) -------------------------------------------------
    def add(self, name: str, *, replace: bool = False) -> str:
        """Make a token for ``name``, store its hash, and return the token (once)."""
        self.refresh()
        if name in self._hashes and not replace:
            raise ConfigError(
                "name", f"{name!r} already has a token; pass --replace to issue a new one"
            )
        token = new_token(name)
        self._hashes[name] = hash_token(token)
        self._save()
        return token

    def remove(self, name: str) -> None:
        """Forget ``name``'s token: it can no longer join."""
        self.refresh()
        if self._hashes.pop(name, None) is None:
            raise ConfigError("name", f"{name!r} has no token in {self.path}")
        self._save()

    def _save(self) -> None:
        lines = [_HEADER, "[tokens]\n"]
        lines += [f'"{name}" = "{digest}"\n' for name, digest in sorted(self._hashes.items())]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, "".join(lines).encode("utf-8"))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        with contextlib.suppress(OSError):
            os.chmod(self.path, 0o600)
        self._stamp = self._read_stamp()
