"""The JSON report every benchmark writes beside its printed table."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any


def print_targets(checks: list[dict[str, Any]]) -> None:
    """One ``[met]`` / ``[MISSED]`` line per target."""
    for c in checks:
        unit = f" {c['unit']}" if c.get("unit") else ""
        print(f"[{'met' if c['met'] else 'MISSED'}] {c['target']}: {c['value']}{unit}")


def write_report(
    benchmark: str,
    args: argparse.Namespace,
    results: list[dict[str, Any]],
    checks: list[dict[str, Any]],
    out: Path,
) -> Path:
    """Write the run's results, targets, arguments and machine as JSON to ``out``."""
    report = {
        "benchmark": benchmark,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {"python": sys.version.split()[0], "platform": platform.platform()},
        "args": {k: str(v) for k, v in vars(args).items()},
        "results": results,
        "targets": checks,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out}")
    return out
