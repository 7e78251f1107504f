"""The fuzz suite of ``tests/fuzz``, run long: counts the inputs tried and any failures.

The CI tests run each target for a few dozen derandomized examples; this script runs
the same targets with fresh randomness for a time budget (or an example count) each:

- ``codec``: random messages built from the descriptors, and byte-mutated valid
  messages, through every ``x_from_proto`` (only `MessageRejectedError` may come out;
  accepted values re-encode to themselves);
- ``receiver``: chunk streams in random orders and shapes into `PayloadReceiver`;
- ``server-raw``: random or mutated bytes as the request of every Fleet method, over a
  real channel to a live server;
- ``server-sessions``: random sequences of RPCs by joined clients (see
  ``tests/fuzz/fuzz_server_targets.py``), then a round with honest clients;
- ``client``: random pull streams from a hostile server into the SDK's `Connection`.

    python benchmarks/fuzz.py                     # 20 s per target
    python benchmarks/fuzz.py --seconds 120       # longer
    .venv/bin/python benchmarks/fuzz.py --seconds 60

Prints a table and writes ``benchmarks/results/fuzz.json``. Exit status 1 if anything
failed (the failing input, shrunk by hypothesis, is in the report).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "fuzz"), str(ROOT / "tests")]

from fuzz_codec_targets import (  # noqa: E402
    DECODERS,
    check_decoder,
    check_receiver,
    mutate,
    parse_or_none,
    valid_or_random,
)
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


class Target:
    """One fuzz target: a hypothesis test body and its input strategy."""

    def __init__(self, name: str, strategy: st.SearchStrategy[Any], body: Callable[..., Any]):
        self.name, self.strategy, self.body = name, strategy, body
        self.inputs = 0
        self.failures: list[str] = []

    def run(self, seconds: float, batch: int) -> None:
        deadline = time.monotonic() + seconds

        def counted(value: Any) -> None:
            self.inputs += 1
            self.body(value)

        test = settings(
            max_examples=batch,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )(given(self.strategy)(counted))
        while time.monotonic() < deadline and len(self.failures) < 3:
            try:
                test()
            except Exception as exc:  # a failure: hypothesis shrank it already
                text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
                self.failures.append(text[:4000])


def codec_targets() -> list[Target]:
    targets = []
    ops = st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 1 << 16), st.integers(0, 255)),
        min_size=1,
        max_size=8,
    )
    for cls, decode, encode in DECODERS:
        targets.append(
            Target(
                f"codec {cls.__name__}",
                valid_or_random(cls),
                lambda m, d=decode, e=encode: check_decoder(d, e, m),
            )
        )

        def mutated(case: Any, cls: Any = cls, d: Any = decode, e: Any = encode) -> None:
            message, edits = case
            parsed = parse_or_none(cls, mutate(message.SerializeToString(), edits))
            if parsed is not None:
                check_decoder(d, e, parsed)

        targets.append(
            Target(f"codec {cls.__name__} (mutated)", st.tuples(valid_or_random(cls), ops), mutated)
        )
    return targets


def receiver_target() -> Target:
    from test_fuzz_codec import _payload_and_chunks

    return Target("receiver chunk streams", _payload_and_chunks(), lambda c: check_receiver(*c))


def server_targets(state: Path) -> tuple[list[Target], Callable[[], dict[str, Any]]]:
    from fuzz_server_targets import (
        SessionRunner,
        cancelled_upload,
        fuzz_weights,
        raw_calls,
        run_raw_call,
        sessions,
    )
    from fuzz_wire import RawClient
    from test_fuzz_servicer import fuzz_server_config

    from fedloom.server import Server

    handle = Server(fuzz_server_config(state), initial_weights=fuzz_weights()).start()
    raw = RawClient(handle.address, name="raw-bytes")
    calls = {"actions": 0}

    def session(actions: Any) -> None:
        runner = SessionRunner(handle.address)
        try:
            runner.play(actions)
            calls["actions"] += len(actions)
        finally:
            runner.close()

    def cancelled(_: Any) -> None:
        cancelled_upload(handle)

    targets = [
        Target("server raw bytes", raw_calls(), lambda c: run_raw_call(raw, *c)),
        Target("server sessions of RPCs", sessions(), session),
        Target("server cancelled uploads", st.just(None), cancelled),
    ]

    def finish() -> dict[str, Any]:
        """An honest round after all that; then stop the server."""
        from helpers import ScriptedClient, run_clients

        coordinator = handle.server.coordinator
        assert coordinator is not None
        seen = len(coordinator.history)
        stop = threading.Event()
        clients = [ScriptedClient(seed=i, num_examples=3) for i in range(2)]
        threads = run_clients(handle.address, [*clients], stop=stop)
        deadline = time.monotonic() + 60
        ok = False
        while time.monotonic() < deadline and not ok:
            ok = any(r.num_updates >= 1 for r in coordinator.history[seen:]) and all(
                c.sent for c in clients
            )
            time.sleep(0.05)
        alive = handle.thread.is_alive()
        stop.set()
        raw.close()
        handle.stop()
        handle.wait(30)
        for t in threads:
            t.join(10)
        return {
            "honest_round_after_fuzzing": ok,
            "server_alive": alive,
            "session_actions": calls["actions"],
            "rounds": len(coordinator.history),
        }

    return targets, finish


def client_target() -> tuple[Target, Callable[[], None]]:
    from concurrent import futures

    import grpc
    from test_client_validates_server import HostileServer, _pull, _task

    from fedloom.client_sdk.connection import ResultRefusedError
    from fedloom.errors import TransportError
    from fedloom.protos.fedloom.v1 import fleet_pb2 as pb
    from fedloom.protos.fedloom.v1 import fleet_pb2_grpc as pb_grpc

    servicer = HostileServer()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_FleetServicer_to_server(servicer, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()

    def body(blobs: list[bytes]) -> None:
        parts = []
        for blob in blobs:
            try:
                parts.append(pb.PullResponse.FromString(blob))
            except Exception:
                parts.append(pb.PullResponse(chunk=pb.Chunk(offset=0, data=blob)))
        with contextlib.suppress(TransportError, ResultRefusedError):  # refused: fine
            _pull(servicer, address, [_task(), *parts])

    strategy = st.lists(st.binary(max_size=80), max_size=8)
    return Target("client: hostile pull streams", strategy, body), lambda: server.stop(0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="time budget per target")
    parser.add_argument("--batch", type=int, default=200, help="examples per hypothesis run")
    parser.add_argument("--only", default="", help="run targets whose name contains this")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fuzz.json"))
    args = parser.parse_args()
    import logging

    logging.basicConfig(level=logging.ERROR)  # rejected messages log warnings by design
    started = time.time()
    extra: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        targets = [*codec_targets(), receiver_target()]
        server, finish_server = server_targets(Path(tmp) / "state")
        client, finish_client = client_target()
        targets += [*server, client]
        if args.only:
            targets = [t for t in targets if args.only in t.name]
        # Codec targets are many and cheap: they share one budget slot each, scaled.
        for target in targets:
            budget = args.seconds / 4 if target.name.startswith("codec") else args.seconds
            slow = "sessions" in target.name  # a session is several RPCs: smaller batches
            target.run(budget, max(10, args.batch // 8) if slow else args.batch)
            status = "FAIL" if target.failures else "ok"
            print(f"{target.name:40s} {target.inputs:9d} inputs  {status}", flush=True)
        extra = finish_server()
        finish_client()
    total = sum(t.inputs for t in targets)
    failures = {t.name: t.failures for t in targets if t.failures}
    print(f"{'total':40s} {total:9d} inputs  {len(failures)} failing targets")
    print(f"after the fuzzing: {extra}")
    report = {
        "inputs_total": total,
        "failures": failures,
        "targets": {t.name: t.inputs for t in targets},
        "server": extra,
        "seconds": round(time.time() - started, 1),
        "budget_s_per_target": args.seconds,
        "machine": platform.platform(),
        "python": platform.python_version(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    ok = not failures and extra.get("honest_round_after_fuzzing") and extra.get("server_alive")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
