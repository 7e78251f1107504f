"""`fedloom runs`: past runs and their per-round metrics, read from the run store.

The database is opened read-only, so the command is safe beside a running server::

    $ fedloom runs --state-dir fedloom-state
    RUN                     STATUS    ROUNDS  STARTED              LOSS    ACCURACY
    20260105-103102-3f2a9c  finished  20/20   2026-01-05 10:31:02  0.1093  0.9694

    $ fedloom runs 20260105-103102          # a unique prefix of the run id is enough
    ROUND  STATUS  SAMPLED  UPDATES  FAILED  CANCELLED  SECONDS  LOSS    ACCURACY
    1      ok      8        8        0       0          1.92     1.9634  0.5722
    ...

Loss and accuracy come from server-side evaluation when the server has an
``evaluate_fn``, else from federated evaluation. ``--json`` prints everything the
store holds (each round's fit, evaluate and server metrics) as one JSON document.

``--clients`` shows one run's per-client metrics (``[metrics] per_client``), a line per
client and phase of each round; with ``--json`` each round gets a ``clients`` list::

    $ fedloom runs 20260105-103102 --clients
    run 20260105-103102-3f2a9c (finished, 20 of 20 rounds committed): per-client metrics
    ROUND  PHASE     CLIENT    EXAMPLES  LOSS    METRICS
    1      fit       hospital  1200      -       train_loss=0.8312
    1      evaluate  hospital  300       0.4120  accuracy=0.8833
"""

from __future__ import annotations

import json
import math
import sqlite3
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from fedloom._text import one_line
from fedloom.errors import ConfigError
from fedloom.records import headline_evaluation
from fedloom.server.store import (
    DATABASE,
    ClientRow,
    RoundRow,
    RunRecord,
    RunStore,
    unusable_database,
)


def open_store(state_dir: str | Path) -> RunStore:
    """The run store in ``state_dir``, read-only; ConfigError when there is none."""
    path = Path(state_dir) / DATABASE
    if not path.is_file():
        raise ConfigError(
            "state_dir", f"no run database at {path}: pass the server's state_dir (--state-dir)"
        )
    return RunStore(path, readonly=True)  # ConfigError when it is not a run store


def _pick(metrics: dict[str, Any], key: str) -> Any:
    """A headline metric of a round (`fedloom.records.headline_evaluation`)."""
    return headline_evaluation(metrics.get("server"), metrics.get("evaluate")).get(key)


def _number(value: Any, spec: str = ".4f") -> str:
    return "-" if not isinstance(value, int | float) else format(value, spec)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    # Cells hold what clients sent (metric names and strings): escaped, so a newline
    # cannot forge a row and an escape sequence cannot reach the terminal.
    cells = [[one_line(c) for c in r] for r in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(line.rstrip() for line in lines)


def _stamp(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def _training_rounds(store: RunStore, run_id: str) -> list[RoundRow]:
    return [r for r in store.rounds(run_id) if r.round > 0]  # round 0: the initial model


def runs_table(store: RunStore) -> str:
    """One line per run: status, rounds committed, start, and the last loss/accuracy."""
    rows = []
    for run in store.runs():
        rounds = _training_rounds(store, run.run_id)
        last = rounds[-1].metrics if rounds else {}
        done = rounds[-1].round if rounds else 0
        rows.append(
            [
                run.run_id,
                run.status,
                f"{done}/{run.num_rounds}",
                _stamp(run.created_at),
                _number(_pick(last, "loss")),
                _number(_pick(last, "accuracy")),
            ]
        )
    if not rows:
        return "no runs yet"
    return _table(["RUN", "STATUS", "ROUNDS", "STARTED", "LOSS", "ACCURACY"], rows)


def rounds_table(store: RunStore, run: RunRecord) -> str:
    """One line per committed round of ``run`` (with ε spent, in a private run)."""
    rows = []
    rounds = _training_rounds(store, run.run_id)
    private = any("privacy_epsilon" in r.metrics.get("fit", {}) for r in rounds)
    for r in rounds:
        m = r.metrics
        rows.append(
            [
                str(r.round),
                r.status,
                str(m.get("num_sampled", "-")),
                str(m.get("num_updates", "-")),
                str(m.get("num_failures", "-")),
                str(m.get("num_cancelled", "-")),
                _number(m.get("duration_s"), ".2f"),
                _number(_pick(m, "loss")),
                _number(_pick(m, "accuracy")),
                *([_number(m.get("fit", {}).get("privacy_epsilon"), ".3f")] if private else []),
            ]
        )
    title = f"run {run.run_id} ({run.status}, {len(rows)} of {run.num_rounds} rounds committed)"
    if not rows:
        return f"{title}\nno rounds committed yet"
    header = ["ROUND", "STATUS", "SAMPLED", "UPDATES", "FAILED", "CANCELLED", "SECONDS"]
    extra = ["EPSILON"] if private else []
    return f"{title}\n" + _table([*header, "LOSS", "ACCURACY", *extra], rows)


def _metric_text(value: Any) -> str:
    if isinstance(value, float):
        return format(value, ".4g")
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


def _metrics_text(metrics: dict[str, Any]) -> str:
    """``name=value`` pairs by name (the wire does not keep a client's order)."""
    return " ".join(f"{k}={_metric_text(v)}" for k, v in sorted(metrics.items()))


def unrecorded_reason(run: RunRecord) -> str:
    """Why a run's configuration kept no per-client metrics ("" when it kept them)."""
    config = run.config
    if not (config.get("metrics") or {}).get("per_client", True):
        return "metrics.per_client = false"
    if (config.get("secure_aggregation") or {}).get("enabled"):
        return "secure aggregation keeps only aggregates"
    if (config.get("privacy") or {}).get("mode", "off") != "off":
        return "differential privacy keeps only aggregates"
    return ""


def clients_table(store: RunStore, run: RunRecord) -> str:
    """One line per client and phase of each committed round of ``run``."""
    title = f"run {run.run_id} ({run.status}): per-client metrics"
    rows = [
        [str(server_round), c.phase, c.client_name or c.client_id, str(c.num_examples),
         _number(c.loss), _metrics_text(c.metrics)]
        for server_round, clients in store.client_rows(run.run_id).items() for c in clients
    ]
    if not rows:
        why = unrecorded_reason(run) or "none recorded"
        return f"{title}\nno per-client metrics ({why})"
    return f"{title}\n" + _table(
        ["ROUND", "PHASE", "CLIENT", "EXAMPLES", "LOSS", "METRICS"], rows)


def _client_json(row: ClientRow) -> dict[str, Any]:
    return {"phase": row.phase, "client_id": row.client_id, "client_name": row.client_name,
            "num_examples": row.num_examples, "loss": row.loss, "metrics": row.metrics}


def _json_default(value: Any) -> Any:
    return value.hex() if isinstance(value, bytes) else str(value)


def _strict(value: Any) -> Any:
    """``value`` with every non-finite float as None: strict JSON (what `jq` and most
    parsers read) has no NaN or Infinity, and a database written by an older version, or
    by an evaluation function that returned one, may hold them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_strict(v) for v in value]
    return value


def find_run(store: RunStore, prefix: str) -> RunRecord:
    """The run whose id is ``prefix`` or starts with it (ConfigError if none or several)."""
    matches = [r for r in store.runs() if r.run_id.startswith(prefix)]
    exact = [r for r in matches if r.run_id == prefix]
    if exact:
        return exact[0]
    if len(matches) != 1:
        known = ", ".join(r.run_id for r in store.runs()) or "none"
        problem = "matches several runs" if matches else "matches no run"
        raise ConfigError("run", f"{prefix!r} {problem}; runs: {known}")
    return matches[0]


def as_json(store: RunStore, run: RunRecord | None, clients: bool = False) -> dict[str, Any]:
    """Every run (or one), each with its committed rounds and their metrics (and, with
    ``clients``, each round's per-client rows)."""
    runs = [run] if run is not None else store.runs()
    return {"runs": [_run_json(store, r, clients) for r in runs]}


def _run_json(store: RunStore, r: RunRecord, clients: bool) -> dict[str, Any]:
    per_client = store.client_rows(r.run_id) if clients else {}
    rounds = []
    for x in store.rounds(r.run_id):
        entry = {"round": x.round, "status": x.status, "started_at": x.started_at,
                 "finished_at": x.finished_at, "checkpoint": x.checkpoint,
                 "metrics": x.metrics}
        if clients:
            entry["clients"] = [_client_json(c) for c in per_client.get(x.round, [])]
        rounds.append(entry)
    return {"run_id": r.run_id, "status": r.status, "num_rounds": r.num_rounds,
            "created_at": r.created_at, "config": r.config, "rounds": rounds}


def print_runs(
    state_dir: str | Path, run_id: str = "", *, json_output: bool = False,
    clients: bool = False, out: TextIO | None = None,
) -> None:
    """What ``fedloom runs`` prints: all runs, or one run's rounds (``run_id`` prefix),
    or with ``clients`` that run's per-client metrics."""
    if clients and not run_id:
        raise ConfigError("--clients", "shows one run: name it (fedloom runs RUN_ID --clients)")
    out = out or sys.stdout
    store = open_store(state_dir)
    try:
        run = find_run(store, run_id) if run_id else None
        if json_output:
            json.dump(_strict(as_json(store, run, clients)), out, indent=2,
                      default=_json_default, allow_nan=False)
            out.write("\n")
        elif run is not None and clients:
            out.write(clients_table(store, run) + "\n")
        else:
            out.write((rounds_table(store, run) if run else runs_table(store)) + "\n")
    except sqlite3.Error as exc:  # a copy without its -wal file has no tables, say
        raise ConfigError("state_dir", unusable_database(store.path, exc)) from exc
    finally:
        store.close()
