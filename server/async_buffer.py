"""The asynchronous rounds' buffers: one server step's updates in memory (`StepBuffer`),
and on disk (`DurableBuffer`), where acknowledged updates survive a crash.

Before a client hears that its update was accepted, the update's spool file is flushed
to disk (fsync), moved into ``buffer/<run_id>/`` and recorded in the run store
(`fedloom.server.store.BufferedRow`, one SQLite transaction). A server step commits a
model version (`fedloom.server.persistence`) and then forgets that version's updates.
A restarted server reads back the updates of the versions after its last commit, each
checked against its SHA-256 digest, so it loses no update it acknowledged; the rows and
files of committed versions (a crash between the commit and the cleanup) are deleted.
An encoded update (docs/compression.md) is kept encoded; its row records the codec, with
its settings, so that a restarted server decodes it as the one that acknowledged it did.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import json
import logging
import os
import queue
from pathlib import Path
from typing import Any

from fedloom.compression import CodecSpec, CompressionError, DecodedWeights, encoded_layout
from fedloom.payload import PayloadInfo
from fedloom.server.checkpoint import fsync_dir
from fedloom.server.store import BufferedRow, RunStore
from fedloom.server.tasks import Task
from fedloom.server.uploads import SpooledWeights
from fedloom.types import ClientUpdate, Metrics
from fedloom.weights import TensorSpec, Weights

log = logging.getLogger("fedloom.server")


@dataclasses.dataclass(frozen=True)
class BufferEntry:
    """A durable update: its record and its delta (read from the file on access, and
    decoded tensor by tensor when it was encoded)."""

    row: BufferedRow
    weights: Weights

    @property
    def contributor(self) -> str:
        """Who the update counts against in ``rounds.max_updates_per_client``."""
        return self.row.contributor or self.row.client_id

    def update(self) -> ClientUpdate:
        return ClientUpdate(self.row.client_id, self.weights, self.row.num_examples,
                            self.row.base_round, self.row.metrics)


#: Flush a file's bytes to disk (blocking: run it off the event loop); fsync works on a
#: file's descriptor as on a folder's.
sync_file = fsync_dir


def _file_problem(path: Path, sha256: str) -> str:
    """Why the file at ``path`` is not the recorded update ("" when it is)."""
    sha = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            while block := fh.read(1 << 20):
                sha.update(block)
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    return "" if sha.hexdigest() == sha256 else "does not match its digest"


class DurableBuffer:
    """Keeps, recovers and forgets the acknowledged updates of one run."""

    def __init__(self, store: RunStore, state_dir: Path, run_id: str,
                 specs: tuple[TensorSpec, ...]) -> None:
        self.store = store
        self.state_dir = state_dir
        self.run_id = run_id
        self.specs = specs
        self.folder = state_dir / "buffer" / run_id

    def keep(self, version: int, client_id: str, base_round: int, num_examples: int,
             metrics: Metrics, spool_path: Path, info: PayloadInfo,
             codec: CodecSpec | None = None, contributor: str = "") -> BufferEntry:
        """Record an update whose spool file is already on disk (`sync_file`): move the
        file into the buffer folder, then commit its row. Quick: call it on the loop."""
        self.folder.mkdir(parents=True, exist_ok=True)
        target = self.folder / f"v{version:06d}-{spool_path.name}"
        os.replace(spool_path, target)
        fsync_dir(self.folder)
        row = BufferedRow(version, client_id, base_round, num_examples, dict(metrics),
                          str(target.relative_to(self.state_dir)), info.sha256.hex(),
                          codec=_codec_text(codec), contributor=contributor)
        try:
            seq = self.store.buffer_update(self.run_id, row)
        except BaseException:
            target.unlink(missing_ok=True)
            raise
        return BufferEntry(dataclasses.replace(row, seq=seq), self._delta(target, codec))

    def _delta(self, path: Path, codec: CodecSpec | None) -> Weights:
        if codec is None:
            return SpooledWeights(path, self.specs)
        spooled = SpooledWeights(path, encoded_layout(codec.build(), self.specs))
        return DecodedWeights(codec.build(), self.specs, spooled)

    def recover(self, completed_round: int) -> list[BufferEntry]:
        """The acknowledged updates of versions after ``completed_round``, verified, in
        the order they were acknowledged; everything else in the folder is deleted."""
        self.store.forget_buffered(self.run_id, completed_round)
        entries: list[BufferEntry] = []
        kept: set[Path] = set()
        for row in self.store.buffered_updates(self.run_id):
            path = self.state_dir / row.path
            problem = _file_problem(path, row.sha256)
            try:
                codec = _codec_of(row.codec)
            except (CompressionError, ValueError, TypeError, KeyError) as exc:
                problem = f"names a codec this server cannot build ({exc})"
            if problem:
                log.error("an acknowledged update from %s for version %d is lost: %s %s",
                          row.client_id, row.version, row.path, problem)
                continue
            entries.append(BufferEntry(row, self._delta(path, codec)))
            kept.add(path)
        if self.folder.is_dir():
            for path in self.folder.iterdir():
                if path not in kept:
                    path.unlink(missing_ok=True)
        if entries:
            log.info("recovered %d acknowledged updates for versions %d..%d", len(entries),
                     entries[0].row.version, entries[-1].row.version)
        return entries

    def forget(self, through_version: int | None = None) -> None:
        """Drop the updates of versions up to ``through_version`` (all: None): rows
        first, then files (a crash between leaves files that `recover` deletes)."""
        self.store.forget_buffered(self.run_id, through_version)
        if not self.folder.is_dir():
            return
        for path in self.folder.glob("v*-*.bin"):
            try:
                version = int(path.name[1:7])
            except ValueError:
                continue
            if through_version is None or version <= through_version:
                path.unlink(missing_ok=True)


def _codec_text(codec: CodecSpec | None) -> str:
    """A codec as its buffer row records it ("" for a plain update)."""
    if codec is None:
        return ""
    return json.dumps({"name": codec.name, **codec.settings()}, sort_keys=True)


def _codec_of(text: str) -> CodecSpec | None:
    if not text:
        return None
    settings = json.loads(text)
    return CodecSpec.of(settings.pop("name"), **settings)


class StepBuffer:
    """The updates of one server step: round ``version`` is what their step produces."""

    def __init__(self, version: int, size: int) -> None:
        self.version = version
        self.size = size
        self.updates: queue.Queue[Any] = queue.Queue()  # to the aggregation thread
        self.entries: list[BufferEntry] = []
        self.contributors: collections.Counter[str] = collections.Counter()  # updates each
        self.tasks: list[Task] = []  # accepted into this buffer: closed at its commit
        self.num_failures = 0
        self.full = asyncio.Event()

    @property
    def count(self) -> int:
        return len(self.entries)

    def staleness(self, base_version: int) -> int:
        """Versions between ``base_version`` and the model this buffer's step updates."""
        return self.version - 1 - base_version
