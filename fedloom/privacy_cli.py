"""``fedloom privacy calibrate`` and the server's ``[privacy]`` flags."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Callable
from typing import Any

from fedloom.privacy import PrivacyConfig
from fedloom.settings import field_help


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    """Flags for the [privacy] table (docs/privacy.md)."""
    group = parser.add_argument_group("differential privacy ([privacy] table)")
    kinds: dict[str, Callable[[str], Any]] = {"float": float, "str": str}
    for field in dataclasses.fields(PrivacyConfig):
        flag = "--privacy" if field.name == "mode" else "--privacy-" + field.name.replace(
            "_", "-")
        group.add_argument(flag, dest=f"privacy_{field.name}", type=kinds[str(field.type)],
                           default=None, metavar=str(field.type).upper(),
                           help=f"{field_help(field)} (default: {field.default})")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("privacy", help="differential-privacy tools")
    tools = p.add_subparsers(dest="privacy_command", required=True)
    c = tools.add_parser(
        "calibrate", help="the noise multiplier for a target epsilon",
        description="The smallest noise multiplier z whose rounds spend at most the target "
        "epsilon at delta (dp-accounting's calibration over the events a run records).")
    c.add_argument("--epsilon", type=float, required=True, help="target epsilon")
    c.add_argument("--delta", type=float, default=1e-5, help="delta (default: 1e-5)")
    c.add_argument("--rounds", type=int, required=True, help="rounds the run will release")
    c.add_argument("--sampling", choices=("fixed", "poisson", "none"), default="fixed")
    c.add_argument("--clients", type=int, default=0,
                   help="n: clients sampled from (fixed, poisson, none)")
    c.add_argument("--per-round", type=int, default=0,
                   help="m: clients per round (fixed; poisson: expected, rate = m / n)")
    c.add_argument("--accountant", choices=("rdp", "pld"), default="rdp")
    c.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(log_level="WARNING")


def run(args: argparse.Namespace) -> int:
    from fedloom.privacy import calibrate_noise_multiplier

    rate = args.per_round / args.clients if args.sampling == "poisson" and args.clients else 0.0
    z = calibrate_noise_multiplier(
        args.epsilon, args.delta, args.rounds, sampling=args.sampling,
        sampled=args.per_round, population=args.clients, rate=rate,
        accountant=args.accountant)
    if args.json:
        print(json.dumps({"noise_multiplier": z, "epsilon": args.epsilon, "delta": args.delta,
                          "rounds": args.rounds, "sampling": args.sampling,
                          "accountant": args.accountant}))
    else:
        # Rounded up, never down: a larger z spends less, so the printed value meets
        # the target (rounded to nearest, half the values spent a hair more than it).
        shown = math.ceil(z * 1e4) / 1e4
        print(f"noise_multiplier = {shown:.4f}  # epsilon {args.epsilon:g} at delta "
              f"{args.delta:g} after {args.rounds} rounds ({args.sampling} sampling, "
              f"{args.accountant})")
    return 0
