"""The ``fedloom`` command: the composition root (wings are imported per subcommand).

- ``fedloom server --config server.toml [--flag value ...]``
- ``fedloom client --server HOST:PORT --app module:attr``
- ``fedloom demo [--clients 8 --rounds 20 --seed 0 --out fedloom-out]``
- ``fedloom simulate scenario.toml`` (see ``fedloom.simulations.cli``)
- ``fedloom certs`` / ``fedloom tokens add NAME`` (see ``fedloom.security_cli``)
- ``fedloom runs [RUN_ID] [--state-dir DIR] [--json] [--clients]`` (past runs, per-round
  and per-client metrics)
- ``fedloom export --out FILE [--run RUN] [--round N]`` (a committed round's model)
- ``fedloom privacy calibrate --epsilon 8 --rounds 100 ...`` (see ``fedloom.privacy_cli``)
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import os
import sys
import tomllib
from collections.abc import Callable, Sequence
from typing import Any

from fedloom import privacy_cli, security_cli
from fedloom.config import (
    CompressionConfig,
    MetricsConfig,
    RoundsConfig,
    ServerConfig,
    TransferConfig,
    from_mapping,
    load_toml,
)
from fedloom.errors import ClientsUnavailableError, ConfigError, FedloomError, TransportError
from fedloom.logs import FORMATS, JsonFormatter, configure_logging
from fedloom.secagg import SecAggConfig
from fedloom.settings import field_help

#: Exit statuses of ``fedloom server``, for supervisors (docs/operations.md, "Exit
#: status"): only a finished run exits 0, so ``Restart=on-failure`` (systemd) or a
#: Kubernetes Job restarts a server that still has rounds to run, and never one whose
#: run is over.
EXIT_FINISHED = 0  # the run is over: do not restart
EXIT_FAILED = 1  # an unexpected error; started again, the server resumes the run
EXIT_REFUSED = 2  # a setting, file or state folder needs fixing: a restart cannot help
EXIT_STOPPED = 75  # SIGTERM/SIGINT, or min_clients_wait_s passed, with rounds to go
#                   (EX_TEMPFAIL); a restart resumes

#: The levels ``--log-level`` takes (any case).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "WARN", "ERROR", "CRITICAL", "FATAL")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _add_fields(parser: argparse.ArgumentParser, cls: type[Any], dest_prefix: str) -> None:
    """A flag per scalar field of ``cls``, its help from the field's metadata."""
    parsers: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "bool": _parse_bool}
    for field in dataclasses.fields(cls):
        # Tables have flags of their own; --insecure is security_cli's.
        if field.default is dataclasses.MISSING or field.name == "insecure":
            continue
        # A true/false setting may stand alone (--new-run) or take its value (--resume false).
        switch: dict[str, Any] = {"nargs": "?", "const": True} if str(field.type) == "bool" else {}
        parser.add_argument(
            _flag(field.name),
            dest=dest_prefix + field.name,
            type=parsers.get(str(field.type), str),
            default=None,
            metavar=str(field.type).upper(),
            help=f"{field_help(field)} (default: {field.default})",
            **switch,
        )


def _add_secagg_flags(parser: argparse.ArgumentParser) -> None:
    """Flags for the [secure_aggregation] table (docs/secure-aggregation.md)."""
    group = parser.add_argument_group("secure aggregation ([secure_aggregation] table)")
    for field in dataclasses.fields(SecAggConfig):
        flag = "--secure-aggregation" if field.name == "enabled" else _flag(f"secagg_{field.name}")
        parsers: dict[str, Callable[[str], Any]] = {"int": int, "float": float,
                                                     "bool": _parse_bool}
        kind = parsers[str(field.type)]
        # A true/false setting may stand alone (--secure-aggregation) or take its value.
        switch: dict[str, Any] = {"nargs": "?", "const": True} if str(field.type) == "bool" else {}
        group.add_argument(flag, dest=f"secagg_{field.name}", type=kind, default=None,
                           metavar=str(field.type).upper(),
                           help=f"{field_help(field)} (default: {field.default})", **switch)


def _add_rounds_flags(parser: argparse.ArgumentParser) -> None:
    """Flags for the [rounds] table (docs/async.md)."""
    group = parser.add_argument_group("rounds ([rounds] table: sync or async, FedBuff)")
    kinds: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "str": str}
    for field in dataclasses.fields(RoundsConfig):
        flag = "--rounds-mode" if field.name == "mode" else _flag(f"rounds_{field.name}")
        group.add_argument(flag, dest=f"rounds_{field.name}", type=kinds[str(field.type)],
                           default=None, metavar=str(field.type).upper(),
                           help=f"{field_help(field)} (default: {field.default})")


def _codec_list(text: str) -> list[str]:
    """A comma-separated list of codec names ("" for none)."""
    return [name.strip() for name in text.split(",") if name.strip()]


def _add_compression_flags(parser: argparse.ArgumentParser) -> None:
    """Flags for the [compression] table (docs/compression.md)."""
    group = parser.add_argument_group("compression ([compression] table: codecs accepted)")
    kinds: dict[str, Callable[[str], Any]] = {"int": int, "float": float}
    defaults = CompressionConfig()
    for field in dataclasses.fields(CompressionConfig):
        listed = field.name in ("upload", "download")
        default = getattr(defaults, field.name)
        group.add_argument(_flag(f"compression_{field.name}"), dest=f"compression_{field.name}",
                           type=_codec_list if listed else kinds[str(field.type)],
                           default=None, metavar="A,B" if listed else str(field.type).upper(),
                           help=f"{field_help(field)} (default: "
                                f"{(','.join(default) or 'none') if listed else default})")


def _add_metrics_flags(parser: argparse.ArgumentParser) -> None:
    """Flags for the [metrics] table (docs/operations.md)."""
    group = parser.add_argument_group("metrics ([metrics] table: what the run store keeps)")
    for field in dataclasses.fields(MetricsConfig):  # true/false settings
        group.add_argument(_flag(f"metrics_{field.name}"), dest=f"metrics_{field.name}",
                           type=_parse_bool, nargs="?", const=True, default=None,
                           metavar="BOOL", help=f"{field_help(field)} (default: "
                                                f"{str(field.default).lower()})")


def _server_parser(sub: Any) -> None:
    from fedloom.strategies import describe_strategies  # numpy only; lists every setting

    p = sub.add_parser(
        "server",
        help="run the aggregation server",
        description="Run the aggregation server. Settings come from "
        "defaults, then --config FILE, then flags.",
        epilog=describe_strategies() + "\n\nGuide: docs/strategies.md",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="TOML file of settings: top-level keys and the tables "
                                    "[strategy], [tls], [auth], [transfer], [rounds], "
                                    "[secure_aggregation], [privacy], [compression], [metrics]; "
                                    "a flag overrides the file")
    p.add_argument("--initial-weights", help="safetensors file of the starting model")
    p.add_argument("--evaluate-fn", help="module:attr of evaluate_fn(round, weights)")
    p.add_argument("--strategy", help="strategy name (the list follows the options)")
    p.add_argument(
        "--strategy-param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a strategy setting; VALUE is TOML (e.g. eta=0.01); repeatable",
    )
    _add_log_level(p, "INFO")
    _add_log_format(p)
    _add_fields(p, ServerConfig, "cfg_")
    _add_fields(p, TransferConfig, "transfer_")
    _add_secagg_flags(p)
    _add_rounds_flags(p)
    _add_compression_flags(p)
    _add_metrics_flags(p)
    privacy_cli.add_server_flags(p)
    security_cli.add_server_flags(p)


def _load_attr(spec: str, setting: str) -> Any:
    module_name, sep, attr = spec.rpartition(":")
    if not sep:
        raise FedloomError(f"{setting}: {spec!r} must be module:attr")
    if module_name.endswith(".py") or "/" in module_name or "\\" in module_name \
            or module_name.startswith("."):
        raise FedloomError(
            f"{setting}: {module_name!r} is a file path; give the module's name, importable "
            f"from the working directory (e.g. mymodule:{attr or 'make_client'} for "
            "./mymodule.py; run the command from the folder that holds it, or add that "
            "folder to PYTHONPATH)")
    sys.path.insert(0, ".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise FedloomError(f"{setting}: cannot load {spec!r}: {exc}") from exc


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    data: dict[str, Any] = load_toml(args.config) if args.config else {}
    for key, value in vars(args).items():
        if value is None:
            continue
        if key.startswith("cfg_"):
            data[key[4:]] = value
        elif key.startswith("transfer_"):
            data.setdefault("transfer", {})[key[9:]] = value
        elif key.startswith("secagg_"):
            data.setdefault("secure_aggregation", {})[key[7:]] = value
        elif key.startswith("rounds_"):
            data.setdefault("rounds", {})[key[7:]] = value
        elif key.startswith("compression_"):
            data.setdefault("compression", {})[key[12:]] = value
        elif key.startswith("metrics_"):
            data.setdefault("metrics", {})[key[8:]] = value
        elif key.startswith("privacy_") and key != "privacy_command":
            data.setdefault("privacy", {})[key[8:]] = value
        elif key.startswith(("tls_", "auth_")):  # security_cli's flags: [tls] / [auth]
            table, _, name = key.partition("_")
            data.setdefault(table, {})[name] = value
    strategy = dict(data.get("strategy", {}))
    if args.strategy:
        strategy["name"] = args.strategy
    for item in args.strategy_param:
        key, sep, raw = item.partition("=")
        if not sep:
            raise FedloomError(f"--strategy-param {item!r}: expected KEY=VALUE")
        try:
            strategy[key] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            strategy[key] = raw
    if strategy:
        data["strategy"] = strategy
    return from_mapping(ServerConfig, data)


def _run_server(args: argparse.Namespace) -> int:
    from fedloom.server import Server, load_weights

    config = server_config_from_args(args)
    if getattr(args, "log_format", "text") == "json" and config.progress:
        # Every stderr line must parse as JSON: the display's table would not, and each
        # round is logged as a record with its fields anyway.
        config = dataclasses.replace(config, progress=False)
    weights = load_weights(args.initial_weights) if args.initial_weights else None
    evaluate_fn = _load_attr(args.evaluate_fn, "--evaluate-fn") if args.evaluate_fn else None
    server = Server(config, initial_weights=weights, evaluate_fn=evaluate_fn)
    try:
        server.run()
    except ClientsUnavailableError as exc:  # a restart can help, once clients can come
        logging.getLogger("fedloom.server").error("the server stops: %s", exc)
        return EXIT_STOPPED
    return EXIT_FINISHED if server.run_finished else EXIT_STOPPED


def _run_client(args: argparse.Namespace) -> int:
    from fedloom.client_sdk import Client, start_client
    from fedloom.client_sdk.tls import channel_credentials

    config = security_cli.client_config_from_args(args)  # TLS settings refused before the app
    codecs = {name: value for name, value in (("upload_codecs", args.upload_codecs),
                                              ("download_codecs", args.download_codecs),
                                              ("state_dir", args.state_dir),
                                              ("max_reconnect_attempts",
                                               args.max_reconnect_attempts),
                                              ("stop_timeout_s", args.stop_timeout_s),
                                              ("secagg_max_attempts",
                                               args.secagg_max_attempts))
              if value is not None}
    config = dataclasses.replace(config, **codecs)
    channel_credentials(config)  # the TLS files checked before the app loads its model
    token = security_cli.client_token_from_args(args)  # and the token
    app = _load_attr(args.app, "--app")
    client = app() if callable(app) and not isinstance(app, Client) else app
    if not isinstance(client, Client):
        raise FedloomError(f"--app {args.app} is not a fedloom Client (or a factory of one)")
    if config.state_dir and os.path.exists(config.state_dir) \
            and not os.path.isdir(config.state_dir):
        raise ConfigError("--state-dir", f"{config.state_dir} is not a folder")
    try:
        stats = start_client(args.server, client, name=args.name or "", token=token,
                             config=config)
    except TransportError as exc:  # gave up reaching the server: a restart may do better
        logging.getLogger("fedloom.client").error("the client stops: %s", exc)
        return EXIT_STOPPED
    print(f"client done: {stats}")
    # As the server's: 0 only once the run is over, so a supervisor restarts a client
    # stopped (SIGTERM, SIGINT) while its run goes on.
    return EXIT_FINISHED if stats.run_finished else EXIT_STOPPED


def _add_log_level(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--log-level", default=default, type=str.upper, choices=LOG_LEVELS)


def _add_state_dir_flags(parser: argparse.ArgumentParser) -> None:
    """Where a command that reads a server's state folder finds it."""
    parser.add_argument("--state-dir", help="the server's state_dir (default: from --config, "
                        "else fedloom-state)")
    parser.add_argument("--config", help="server TOML file whose state_dir to read")


def _add_log_format(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-format",
        choices=FORMATS,
        default="text",
        help="text, or json: one JSON object per line (level, logger, message, fields)",
    )


def _state_dir(args: argparse.Namespace) -> str:
    if args.state_dir:
        return str(args.state_dir)
    data = load_toml(args.config) if args.config else {}
    return str(data.get("state_dir", ServerConfig.state_dir))


def _run_runs(args: argparse.Namespace) -> int:
    from fedloom.server.run_report import print_runs

    try:
        print_runs(_state_dir(args), args.run, json_output=args.json, clients=args.clients)
        sys.stdout.flush()  # here, not at exit, where a closed pipe would be a traceback
    except BrokenPipeError:  # `fedloom runs --json | head`: the reader has what it wanted
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's final flush must not fail too
    return 0


def _run_backup(args: argparse.Namespace) -> int:
    from fedloom.server.backup import backup_state

    report = backup_state(_state_dir(args), args.out)
    for line in report.left_out:
        print(f"left out: {line}", file=sys.stderr)
    print(report.summary())
    return 0


def _run_export(args: argparse.Namespace) -> int:
    from fedloom.server.export import export_model

    run_id, server_round = export_model(_state_dir(args), args.out, args.run, args.round)
    print(f"wrote round {server_round} of run {run_id} to {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedloom", description="fedloom federated learning")
    sub = parser.add_subparsers(dest="command", required=True)
    _server_parser(sub)
    c = sub.add_parser("client", help="run a client defined in a Python module")
    c.add_argument("--server", required=True, help="HOST:PORT of the server")
    c.add_argument("--app", required=True, help="module:attr — a Client, or a function making one")
    c.add_argument("--name", help="a stable name for this client")
    c.add_argument("--token", help="credential, when the server requires one")
    _add_log_level(c, "INFO")
    c.add_argument("--upload-codecs", type=_codec_list, metavar="A,B",
                   help="codecs to send updates in, most wanted first (docs/compression.md)")
    c.add_argument("--download-codecs", type=_codec_list, metavar="A,B",
                   help="codecs to receive the model in, most wanted first")
    c.add_argument("--state-dir", help="folder for this client's own state (top-k's "
                   "error-feedback residual survives a restart there)")
    c.add_argument("--max-reconnect-attempts", type=int, metavar="N",
                   help="give up after N failed reconnects in a row (default: retry "
                   "until stopped)")
    c.add_argument("--secagg-max-attempts", type=int, metavar="N",
                   help="secure rounds: the most attempts of one round this client takes "
                   "part in (1..16, default 3; match the server's "
                   "secure_aggregation.max_attempts)")
    c.add_argument("--stop-timeout-s", type=float, metavar="S",
                   help="on SIGTERM/SIGINT, the seconds from the signal for the task in "
                   "progress to finish and its result to go out; then what is not sent is "
                   "dropped (default 20; the Leave takes at most 5 s more)")
    security_cli.add_client_flags(c)
    security_cli.add_certs_parser(sub)
    privacy_cli.add_parser(sub)
    security_cli.add_tokens_parser(sub)
    _add_log_format(c)
    r = sub.add_parser("runs", help="list past runs, or one run's per-round metrics")
    r.add_argument("run", nargs="?", default="", help="a run id (or a unique prefix of one)")
    _add_state_dir_flags(r)
    r.add_argument("--json", action="store_true", help="print everything as JSON")
    r.add_argument("--clients", action="store_true", help="one run's per-client metrics, "
                   "round by round (with --json: a clients list in each round)")
    r.set_defaults(log_level="WARNING")
    e = sub.add_parser("export", help="write a committed round's model as a safetensors file")
    e.add_argument("--out", required=True, help="the safetensors file to write")
    e.add_argument("--run", default="", help="a run id or a unique prefix (default: the newest)")
    e.add_argument("--round", type=int, default=None,
                   help="the round (default: the last committed; it must still be kept)")
    _add_state_dir_flags(e)
    e.set_defaults(log_level="WARNING")
    b = sub.add_parser("backup", help="copy a state folder consistently, even beside a "
                       "running server (restore: point state_dir at the copy)")
    b.add_argument("out", help="the backup folder to create (it must not exist)")
    _add_state_dir_flags(b)
    b.set_defaults(log_level="WARNING")
    d = sub.add_parser("demo", help="a real federated run on loopback (digits, PyTorch)")
    from fedloom.simulations.demo import add_arguments

    add_arguments(d)
    _add_log_level(d, "WARNING")
    sim = sub.add_parser("simulate", help="run a scenario TOML on the local or Flower engine",
                         add_help=False)
    sim.add_argument("rest", nargs=argparse.REMAINDER)
    sim.set_defaults(log_level="WARNING")
    return parser


#: Packages an install may lack, by import name: the extra that brings each.
_EXTRAS = {"safetensors": "server", "rich": "server", "prometheus_client": "server",
           "dp_accounting": "server", "grpc_health": "server", "grpc_reflection": "server",
           "zstandard": "zstd", "torch": "torch", "sklearn": "demo", "matplotlib": "demo",
           "flwr": "flower", "ray": "flower"}


def _refuse(args: argparse.Namespace, message: str) -> int:
    """Say why a command is refused (one line on stderr: JSON with ``--log-format
    json``, where every stderr line must parse) and return `EXIT_REFUSED`."""
    if getattr(args, "log_format", "text") == "json":  # written whatever --log-level says
        record = logging.LogRecord("fedloom", logging.ERROR, __file__, 0,
                                   "fedloom %s: error: %s", (args.command, message), None)
        print(JsonFormatter().format(record), file=sys.stderr)
    else:
        print(f"fedloom {args.command}: error: {message}", file=sys.stderr)
    return EXIT_REFUSED


def _missing_extra(exc: ImportError) -> str | None:
    """What to install when ``exc`` is a package of an extra this install lacks (a
    device's client install has none of the server's); None for any other error."""
    if 'pip install "fedloom[' in str(exc):
        return str(exc)
    top = (getattr(exc, "name", None) or "").split(".")[0]
    extra = _EXTRAS.get(top)
    if not isinstance(exc, ModuleNotFoundError) or extra is None:
        return None
    return (f"this command needs the {top!r} package, which this install lacks: "
            f'pip install "fedloom[{extra}]"')


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["simulate"]:  # its own parser (fedloom.simulations.cli)
        from fedloom.simulations.cli import main as simulate_main

        return simulate_main(argv[1:])
    args = build_parser().parse_args(argv)
    configure_logging(str(args.log_level), getattr(args, "log_format", "text"))
    if getattr(args, "log_format", "text") == "json":
        # gRPC's C core writes its own plain-text lines to stderr (a port it cannot
        # bind, say); fedloom logs what matters of those as JSON itself.
        os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    try:
        if args.command == "server":
            return _run_server(args)
        if args.command == "client":
            return _run_client(args)
        if args.command == "certs":
            return security_cli.run_certs(args)
        if args.command == "tokens":
            return security_cli.run_tokens(args)
        if args.command == "runs":
            return _run_runs(args)
        if args.command == "export":
            return _run_export(args)
        if args.command == "backup":
            return _run_backup(args)
        if args.command == "privacy":
            return privacy_cli.run(args)
        from fedloom.simulations.demo import main as demo_main

        return demo_main(args)
    except FedloomError as exc:
        return _refuse(args, str(exc))
    except ImportError as exc:
        missing = _missing_extra(exc)
        if missing is not None:
            return _refuse(args, missing)  # a restart cannot install a package
        if args.command != "server":
            raise
        logging.getLogger("fedloom.server").exception("the server failed")
        return EXIT_FAILED
    except Exception:
        if args.command == "client":  # one record with its traceback (JSON logs too)
            logging.getLogger("fedloom.client").exception("the client failed")
            return EXIT_FAILED
        if args.command != "server":
            raise
        # A supervisor restarts on this status; the run resumes from its last commit.
        logging.getLogger("fedloom.server").exception("the server failed")
        return EXIT_FAILED


if __name__ == "__main__":
    raise SystemExit(main())
