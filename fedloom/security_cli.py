"""The security parts of the ``fedloom`` command (hooked into `fedloom.cli`).

- ``fedloom certs [--out DIR] [--host NAME ...] [--client NAME ...]``: a CA, a server
  certificate and client certificates (`fedloom.certs`);
- ``fedloom tokens add|remove|list [NAME] [--file F]``: per-client tokens, stored as
  hashes (`fedloom.tokens`);
- the TLS and authentication flags of ``fedloom server`` and ``fedloom client``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from fedloom.certs import DEFAULT_HOSTS, LEAF_DAYS, write_certificates
from fedloom.config import ClientConfig
from fedloom.errors import ConfigError
from fedloom.tokens import TokenStore

DEFAULT_TOKENS_FILE = "fedloom-tokens.toml"


# -- fedloom server ------------------------------------------------------------------
def add_server_flags(parser: argparse.ArgumentParser) -> None:
    """TLS/auth flags; their dests (``cfg_``, ``tls_``, ``auth_``) map onto ServerConfig."""
    g = parser.add_argument_group("transport security and authentication")
    g.add_argument("--tls-cert", dest="tls_cert", metavar="PEM", help="server certificate")
    g.add_argument("--tls-key", dest="tls_key", metavar="PEM", help="its private key")
    g.add_argument(
        "--tls-client-ca",
        dest="tls_client_ca",
        metavar="PEM",
        help="CA of client certificates: turns on mutual TLS (the CN is the identity)",
    )
    g.add_argument(
        "--tokens-file", dest="auth_tokens_file", metavar="FILE",
        help="hashed client tokens (`fedloom tokens add NAME`)",
    )
    g.add_argument(
        "--allow", dest="auth_allow", action="append", metavar="NAME",
        help="admit only this client identity (repeatable)",
    )
    g.add_argument(
        "--anonymous", dest="auth_anonymous", action="store_const", const=True,
        help="admit clients without credentials (TLS without client identities)",
    )
    g.add_argument(
        "--insecure", dest="cfg_insecure", action="store_const", const=True,
        help="serve PLAINTEXT without TLS (trusted test networks only)",
    )


# -- fedloom client ------------------------------------------------------------------
def add_client_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("transport security")
    g.add_argument("--root-ca", metavar="PEM", help="CA that signed the server's certificate")
    g.add_argument(
        "--system-roots", action="store_true",
        help="trust gRPC's default public CAs (a publicly issued server certificate)",
    )
    g.add_argument("--cert", metavar="PEM", help="this client's certificate (mutual TLS)")
    g.add_argument("--key", metavar="PEM", help="its private key")
    g.add_argument("--server-name", help="name to check in the server's certificate")
    g.add_argument("--peer-ca", metavar="PEM",
                   help="CA of the other clients' certificates, against which secure "
                        "aggregation checks their signatures (default: --root-ca)")
    g.add_argument("--token-file", help="read the token from this file (keeps it out of ps)")
    g.add_argument("--insecure", action="store_true", help="talk PLAINTEXT (test servers only)")


def client_config_from_args(args: argparse.Namespace) -> ClientConfig:
    return ClientConfig(
        server_address=args.server,
        name=args.name or "",
        root_ca=args.root_ca or "",
        system_roots=args.system_roots,
        cert=args.cert or "",
        key=args.key or "",
        server_name=args.server_name or "",
        peer_ca=args.peer_ca or "",
        insecure=args.insecure,
    )


def client_token_from_args(args: argparse.Namespace) -> str:
    """The token from --token, --token-file or $FEDLOOM_TOKEN (in that order)."""
    if args.token:
        return str(args.token)
    if args.token_file:
        try:
            with open(args.token_file, encoding="utf-8") as fh:
                token = fh.read().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError("--token-file", f"cannot read it: {exc}") from exc
        if not token:  # not "no token": the operator meant to pass one
            raise ConfigError("--token-file", f"{args.token_file} is empty")
        return token
    return os.environ.get("FEDLOOM_TOKEN", "")


# -- fedloom certs -------------------------------------------------------------------
def add_certs_parser(sub: Any) -> None:
    p = sub.add_parser(
        "certs",
        help="create a CA, a server certificate and client certificates",
        description="Create (or extend) a folder of PEM files: ca.pem/ca.key (made when "
        "absent, reused when present), server.pem/server.key, and NAME.pem/NAME.key for "
        "each --client. Keys are written with mode 0600; nothing is overwritten without "
        "--force.",
    )
    p.add_argument("--out", default="fedloom-certs", help="folder (default fedloom-certs)")
    p.add_argument(
        "--host", action="append", metavar="NAME_OR_IP",
        help="a DNS name or IP address clients dial, for the server certificate "
        f"(repeatable; default {' and '.join(DEFAULT_HOSTS)})",
    )
    p.add_argument("--client", action="append", default=[], metavar="NAME",
                   help="issue a client certificate with CN=NAME (repeatable)")
    p.add_argument("--days", type=int, default=LEAF_DAYS,
                   help=f"validity of the certificates issued (default {LEAF_DAYS})")
    p.add_argument("--force", action="store_true", help="replace existing files")
    p.set_defaults(log_level="WARNING")


def run_certs(args: argparse.Namespace) -> int:
    written = write_certificates(
        args.out, hosts=args.host, clients=args.client, days=args.days, force=args.force
    )
    for path in written:
        print(path)
    if not written:
        print(f"nothing to do in {args.out} (add --client NAME or --host NAME)", file=sys.stderr)
    return 0


# -- fedloom tokens ------------------------------------------------------------------
def add_tokens_parser(sub: Any) -> None:
    p = sub.add_parser(
        "tokens",
        help="manage per-client tokens (the server stores only their hashes)",
        description="add NAME prints a new token once (give it to the client) and stores "
        "its hash; remove NAME revokes it (the server notices at the next Join); list "
        "shows the names.",
    )
    p.add_argument("action", choices=["add", "remove", "list"])
    p.add_argument("name", nargs="?", help="the client's name (its identity)")
    p.add_argument("--file", default=DEFAULT_TOKENS_FILE,
                   help=f"the tokens file (default {DEFAULT_TOKENS_FILE})")
    p.add_argument("--replace", action="store_true", help="add: issue a new token for NAME")
    p.set_defaults(log_level="WARNING")


def run_tokens(args: argparse.Namespace) -> int:
    store = TokenStore(args.file)
    store.refresh("--file")
    if args.action == "list":
        for name in store.names():
            print(name)
        return 0
    if not args.name:
        raise ConfigError("name", f"`fedloom tokens {args.action}` needs a client name")
    if args.action == "remove":
        store.remove(args.name)
        print(f"removed {args.name!r} from {store.path}", file=sys.stderr)
        return 0
    token = store.add(args.name, replace=args.replace)
    print(token)
    print(
        f"stored the hash for {args.name!r} in {store.path}; the token is shown only now: "
        "hand it to the client (fedloom client --token-file FILE, or $FEDLOOM_TOKEN)",
        file=sys.stderr,
    )
    return 0
