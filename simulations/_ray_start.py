"""Starting Ray for the Flower engine, with a bounded retry when its head does not come up.

Flower's Ray backend calls ``ray.init`` once and ends the simulation if it fails. A local
Ray head is a handful of processes (GCS server, raylet, ...); on a loaded machine the
GCS server now and then never reports its port, and ``ray.init`` gives up after Ray's
fixed 30 s wait ("Timed out waiting for file .../gcs_server_port_..."), or the raylet
does not register in time ("The current node timed out during startup"). Such a failure
says nothing about the run, and a fresh head (a new session directory and fresh
processes) almost always starts. So `start_ray` starts Ray itself, as Flower would (the
same ``init_args``, logging defaults, no dashboard, the driver's ``sys.path`` passed to
the workers through ``PYTHONPATH``), retrying up to ``attempts`` times with the failed
head shut down in between; Flower's backend then finds Ray running and uses it, and
shuts it down when the simulation ends.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

import ray
from flwr.supercore.constant import DEFAULT_SIMULATION_CONFIG

log = logging.getLogger(__name__)

#: How many times `start_ray` tries to start (or join) Ray before it gives up.
ATTEMPTS = 3


def ray_init_args(backend_config: Mapping[str, Any], verbose: bool) -> dict[str, Any]:
    """The keyword arguments Flower 1.42's Ray backend passes to ``ray.init`` for
    ``backend_config`` (``run_simulation``'s logging defaults when not ``verbose``)."""
    args = dict(backend_config.get("init_args") or {})
    if not verbose:
        args.setdefault("logging_level", DEFAULT_SIMULATION_CONFIG.init_args_logging_level)
        args.setdefault("log_to_driver", DEFAULT_SIMULATION_CONFIG.init_args_log_to_driver)
    args.setdefault("include_dashboard", False)
    return args


def start_ray(backend_config: Mapping[str, Any], *, verbose: bool = False,
              attempts: int = ATTEMPTS) -> bool:
    """Start Ray for a Flower simulation unless it is already running; True when this
    call started it (the caller then shuts it down if the simulation did not).

    Raises RuntimeError, naming the last error, when no attempt of ``attempts`` worked.
    """
    if attempts < 1:
        raise ValueError(f"attempts must be at least 1, got {attempts}")
    if ray.is_initialized():
        return False
    args = ray_init_args(backend_config, verbose)
    pythonpath = os.pathsep.join(sys.path)
    if os.environ.get("PYTHONPATH"):
        pythonpath = f"{pythonpath}{os.pathsep}{os.environ['PYTHONPATH']}"
    os.environ["PYTHONPATH"] = pythonpath  # as Flower's backend does, for Ray's workers
    last: Exception | None = None
    for attempt in range(1, attempts + 1):
        try:
            ray.init(runtime_env={"env_vars": {"PYTHONPATH": pythonpath}}, **args)
            return True
        except Exception as exc:
            if not _failed_to_start(exc):
                raise
            last = exc
            ray.shutdown()  # the half-started head's processes, before a fresh one
            if attempt < attempts:
                log.warning("Ray did not start (attempt %d of %d: %s); starting a fresh "
                            "Ray head", attempt, attempts, exc)
    raise RuntimeError(f"Ray did not start in {attempts} attempts; last error: {last}"
                       ) from last


def _failed_to_start(exc: Exception) -> bool:
    """Whether ``exc`` is Ray's head not coming up (worth a fresh head), not a mistake
    in the arguments: the GCS server's port never reported (RuntimeError), the GCS not
    answering (ConnectionError, TimeoutError), or the raylet not registering within
    Ray's wait, which Ray raises as a bare Exception."""
    if isinstance(exc, RuntimeError | ConnectionError | TimeoutError):
        return True
    return type(exc) is Exception and "timed out during startup" in str(exc)


def stop_ray() -> None:
    """Shut Ray down if it is still running (Flower's backend normally has)."""
    if ray.is_initialized():
        ray.shutdown()
