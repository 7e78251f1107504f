"""The public surface of fedloom.simulations, and its import walls."""

from __future__ import annotations

import subprocess
import sys

import fedloom.simulations as sim


def test_exported_names_are_pinned() -> None:
    assert sorted(sim.__all__) == [
        "DataSplit", "FlowerStrategy", "History", "RoundRecord", "Scenario", "SpeedModel",
        "SyncClock", "client_fit_config", "client_info", "dirichlet_partition", "fit_seed",
        "iid_partition", "load_digits", "load_scenario", "make_mlp", "make_torch_client",
        "run_flower", "run_local", "run_local_async", "run_scenario", "shard_partition",
        "synthetic", "to_client_app",
    ]
    for name in sim.__all__:
        assert getattr(sim, name) is not None


def test_importing_the_package_pulls_neither_torch_nor_flwr() -> None:
    code = (
        "import sys, fedloom.simulations\n"
        "heavy = [m for m in ('torch', 'flwr', 'sklearn', 'matplotlib') "
        "if m in sys.modules]\n"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == ""


def test_the_local_engine_does_not_import_flwr() -> None:
    # flwr is the optional fedloom[flower] extra: run_scenario imports it only for
    # engine = "flower".
    code = (
        "import sys\n"
        "import fedloom.simulations.runner, fedloom.simulations.job\n"
        "print('flwr' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"
