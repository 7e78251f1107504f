"""Error feedback: a client keeps what its lossy codec did not send and adds it to the
next update (Stich et al., NeurIPS 2018; Karimireddy et al., ICML 2019).

With residual ``e`` and update ``u``, the client sends ``C(u + e)`` and keeps
``e' = u + e - C(u + e)``; over rounds everything is sent eventually, which makes top-k
converge like the uncompressed method. The residual is the client's own: it never
leaves the device, and with a ``path`` it is written there after every update
(temp file, fsync, rename: an ``.npz`` read back without pickle), so it survives a
restart of the client. A residual whose layout does not match the update (a new
model) is dropped with a warning.
"""

from __future__ import annotations

import logging
import os
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from fedloom.compression._base import Codec, CompressionError, decode, encode
from fedloom.weights import Weights

log = logging.getLogger("fedloom.compression")


class ErrorFeedback:
    """Encodes updates with ``codec``, carrying what it drops into the next one."""

    def __init__(self, codec: Codec, path: str | Path | None = None) -> None:
        self.codec = codec
        self.path = Path(path) if path is not None else None
        self.residual: dict[str, np.ndarray] = {}
        if self.path is not None and self.path.exists():
            self.residual = _load(self.path)

    def encode(self, update: Weights, rng: np.random.Generator) -> Weights:
        """``update`` plus the residual, encoded; the new residual is kept (and saved)."""
        specs = update.specs()
        residual = self.residual
        if residual and (sorted(residual) != sorted(s.name for s in specs if
                                                    self.codec.applies(s))
                         or any(residual[s.name].shape != s.shape for s in specs
                                if s.name in residual)):
            log.warning("the error-feedback residual does not match this model; starting "
                        "again from zero")
            residual = {}
        corrected = Weights(
            (s.name, (np.asarray(update[s.name], np.float64) + residual[s.name]
                      if s.name in residual else np.asarray(update[s.name], np.float64)
                      ).astype(s.numpy_dtype))
            if self.codec.applies(s) else (s.name, np.asarray(update[s.name]))
            for s in specs)
        try:
            encoded = encode(self.codec, corrected, rng)
        except CompressionError:
            # What it carried is in this update, which goes out some other way or not at
            # all: the next one starts from zero (a residual that cannot encode would
            # spoil every later update too).
            self.reset()
            raise
        sent = decode(self.codec, specs, encoded)
        self.residual = {
            s.name: (np.asarray(corrected[s.name], np.float64)
                     - np.asarray(sent[s.name], np.float64)).astype(np.float32)
            for s in specs if self.codec.applies(s)}
        if self.path is not None:
            try:
                _save(self.path, self.residual)
            except OSError as exc:  # a full disk, a read-only folder: the update goes on
                log.warning("cannot save the error-feedback residual %s (%s); it is kept in "
                            "memory only, and a restart starts from zero", self.path,
                            exc.strerror or exc)
        return encoded

    def reset(self) -> None:
        """Forget the residual (and its file)."""
        self.residual = {}
        if self.path is not None:
            self.path.unlink(missing_ok=True)


def _save(path: Path, residual: dict[str, np.ndarray]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            # Numbered arrays plus a names list: tensor names need not be valid keys.
            arrays: dict[str, np.ndarray] = {f"t{i}": a for i, a in enumerate(residual.values())}
            arrays["names"] = np.array(list(residual), dtype=np.str_)
            np.savez(fh, **arrays)  # type: ignore[arg-type]
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(name, path)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise


def _load(path: Path) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as data:
            names = [str(n) for n in data["names"]]
            residual = {n: np.asarray(data[f"t{i}"], np.float32) for i, n in enumerate(names)}
        bad = next((n for n, a in residual.items() if not np.isfinite(a).all()), None)
        if bad is not None:  # it would be added to every update, which could never encode
            raise ValueError(f"tensor {bad!r} holds non-finite values")
        return residual
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        # A torn or truncated file (not an .npz any more): never a crash at every restart.
        log.warning("cannot read the error-feedback residual %s (%s); starting from zero",
                    path, exc)
        return {}
