"""Server configuration files (TOML), read with their file paths made independent of
the working directory.

A relative path written in a configuration file is relative to the folder of that
file, so the file means the same wherever the server is started from: with
``/etc/fedloom/server.toml`` saying ``cert = "pki/server.pem"`` the server reads
``/etc/fedloom/pki/server.pem``. An absolute path is kept as it is, an empty one (a
setting left unset) too. Paths given as command-line flags, and defaults (``state_dir``
is ``fedloom-state``), stay relative to the working directory, as any path on a command
line. `FILE_SETTINGS` names the settings this applies to.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from fedloom.errors import ConfigError

#: The settings of a server configuration file that name files or folders.
FILE_SETTINGS = ("state_dir", "tls.cert", "tls.key", "tls.client_ca", "auth.tokens_file")


def load_toml(path: str | Path, setting: str = "--config") -> dict[str, Any]:
    """Read a TOML file, turning parse errors into `ConfigError` (naming ``setting``, the
    flag or argument that gave the file); the paths in its `FILE_SETTINGS` are made
    relative to the file's folder (absolute)."""
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError as exc:
        raise ConfigError(setting, f"file {str(path)!r} not found") from exc
    except OSError as exc:  # a folder, no permission
        raise ConfigError(setting, f"cannot read {str(path)!r}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(setting, f"{path} is not valid TOML: not UTF-8 ({exc.reason})") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(setting, f"{path} is not valid TOML: {exc}") from exc
    folder = os.path.dirname(os.path.abspath(path))
    resolved = resolve_paths(data, folder)
    _check_state_dir(data.get("state_dir"), resolved.get("state_dir"), str(path))
    return resolved


def resolve_paths(data: dict[str, Any], folder: str) -> dict[str, Any]:
    """A copy of ``data`` (a configuration file's tables) whose relative paths in
    `FILE_SETTINGS` are joined to ``folder``."""
    out = dict(data)
    for setting in FILE_SETTINGS:
        table_name, _, key = setting.rpartition(".")
        if table_name:
            table = out.get(table_name)
            if not isinstance(table, dict):
                continue  # absent, or not a table: from_mapping says what is wrong
            table = out[table_name] = dict(table)
        else:
            table = out
        value = table.get(key)
        if isinstance(value, str) and value and not os.path.isabs(value):
            table[key] = os.path.normpath(os.path.join(folder, value))
    return out


def _check_state_dir(written: Any, resolved: Any, path: str) -> None:
    """Refuse to start afresh in the file's folder beside a state folder of the same name
    in the working directory: that one holds runs a server may be expected to resume."""
    if not isinstance(written, str) or not written or written == resolved:
        return
    beside = os.path.abspath(written)
    if beside != resolved and os.path.isdir(beside) and not os.path.exists(resolved):
        raise ConfigError(
            "state_dir",
            f"{written!r} in {path} means {resolved} (a relative path in a configuration "
            f"file is relative to the file's folder), which does not exist, while {beside} "
            f"does: write state_dir = {beside!r} to resume the runs kept there, or create "
            f"{resolved} to start afresh",
        )
