"""``fedloom simulate scenario.toml``: run a scenario and write its results.

`main` takes the arguments that follow ``simulate``::

    fedloom simulate scenario.toml                  # results in runs/<scenario name>/
    fedloom simulate scenario.toml --out results/a --engine flower --rounds 3
    fedloom simulate scenario.toml --set num_clients=50 --set partition.alpha=0.1
    fedloom simulate scenario.toml --engine vectorized     # or --workers 2 (local engine)

``--set KEY=VALUE`` overrides any scenario setting (dotted for tables; the value is
read as TOML, so ``--set client.lr=0.1`` is a float and ``--set engine=flower`` may go
unquoted). ``--set rounds.mode=async`` works on a file that says ``rounds = N``: the
count moves to ``num_rounds``, beside the ``[rounds]`` table (see
`fedloom.simulations.scenario`). The ``--out`` folder is created before the run
trains (a file or an unwritable folder is refused); an earlier run's results in it
are replaced, with a warning naming them. Exit status: 0 on success, 2 for a bad
scenario or argument (``--out`` included), 1 for another fedloom error, 75 for
Ctrl-C (the server's ``EXIT_STOPPED``). A run stopped by Ctrl-C or an error writes
the rounds it finished, and the model after the last of them, to ``--out`` first, and
says so on its error line.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedloom.config import load_toml
from fedloom.errors import ConfigError, FedloomError

#: Ctrl-C's exit status: `fedloom.cli`'s ``EXIT_STOPPED``, the server's and client's
#: for SIGINT with rounds to go.
EXIT_STOPPED = 75


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedloom simulate",
        description="Run a simulated federated scenario (local, vectorized or Flower's "
                    "engine).",
    )
    parser.add_argument("scenario", help="scenario TOML file")
    parser.add_argument("--out", help="results folder (default: runs/<scenario name>)")
    parser.add_argument("--engine", choices=("local", "vectorized", "flower"),
                        help="override the engine")
    parser.add_argument("--workers", type=int,
                        help="processes that train the local engine's clients, this one included "
                             "(engine.workers)")
    parser.add_argument("--threads", type=int,
                        help="torch threads of the vectorized engine's batched computation "
                             "(engine.threads)")
    parser.add_argument("--rounds", type=int, help="override the number of rounds")
    parser.add_argument("--seed", type=int, help="override the seed")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override any setting (repeatable; dotted keys for tables)")
    parser.add_argument("--no-progress", action="store_true", help="no progress display")
    return parser


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare string


def _apply(data: dict[str, Any], assignment: str) -> None:
    key, sep, value = assignment.partition("=")
    if not sep or not key.strip():
        raise ConfigError("--set", f"{assignment!r} is not KEY=VALUE")
    *tables, leaf = key.strip().split(".")
    if tables[:1] == ["engine"] and not isinstance(data.get("engine", {}), dict):
        data["engine"] = {"name": data["engine"]}  # engine = "x" becomes its [engine] table
    if not tables and leaf == "engine" and isinstance(data.get("engine"), dict):
        tables, leaf = ["engine"], "name"  # keep the table's options
    if tables[:1] == ["rounds"] and "rounds" in data and not isinstance(data["rounds"], dict):
        data["num_rounds"] = data.pop("rounds")  # the count beside a [rounds] table
    if key.strip() == "rounds" and _server_form(data):
        leaf = "num_rounds"
    node = data
    for table in tables:
        child = node.setdefault(table, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {key}", f"{table!r} is not a table")
        node = child
    node[leaf] = _parse_value(value.strip())


def _server_form(data: dict[str, Any]) -> bool:
    """Whether the scenario counts its rounds in ``num_rounds`` (beside a [rounds] table)."""
    return "num_rounds" in data or isinstance(data.get("rounds"), dict)


def _notes(exc: BaseException) -> str:
    """The notes `run_scenario` adds to an exception (where a stopped run's results
    went), on the same line."""
    notes = getattr(exc, "__notes__", [])
    return "".join(f"; {note}" for note in notes)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``fedloom simulate``; returns the exit status."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        from fedloom.simulations.scenario import scenario_from_mapping

        data = dict(load_toml(args.scenario, "scenario"))
        data.setdefault("name", Path(args.scenario).stem)
        for assignment in args.set:
            _apply(data, assignment)
        if args.engine is not None:
            _apply(data, f"engine.name={args.engine}")
        if args.workers is not None:
            _apply(data, f"engine.workers={args.workers}")
        if args.threads is not None:
            _apply(data, f"engine.threads={args.threads}")
        for key in ("rounds", "seed"):
            if getattr(args, key) is not None:
                server = key == "rounds" and _server_form(data)
                data["num_rounds" if server else key] = getattr(args, key)
        if args.no_progress:
            data["progress"] = False
        scenario = scenario_from_mapping(data)
        out_dir = Path(args.out) if args.out else Path("runs") / scenario.name
        from fedloom.simulations.runner import run_scenario

        history = run_scenario(scenario, out_dir, out_setting="--out")  # checks it first
    except KeyboardInterrupt as exc:
        print(f"fedloom simulate: interrupted{_notes(exc)}", file=sys.stderr)
        return EXIT_STOPPED
    except ConfigError as exc:
        print(f"fedloom simulate: {exc}{_notes(exc)}", file=sys.stderr)
        return 2
    except FedloomError as exc:
        print(f"fedloom simulate: error: {exc}{_notes(exc)}", file=sys.stderr)
        return 1
    accuracy = history.final("test_accuracy")
    summary = f"test accuracy {accuracy:.4f}" if accuracy is not None else "done"
    unit = "versions" if scenario.rounds_config.asynchronous else "rounds"
    print(f"{scenario.name}: {len(history.rounds) - 1} {unit} on {history.engine} in "
          f"{history.wall_s:.1f} s, {summary}; results in {out_dir}/")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
