"""The global model as the server holds it: the weights and the one serialized payload
every fit and evaluate task broadcasts.

The weights are views into the payload (one copy of the model, not two), and installing
a new model lets go of the old payload before building the new one (two copies at the
peak, not three). A model broadcast with a download codec (``[compression] download``)
is encoded once per model version and codec and shared by every client granted that
codec; the zstd frame of a broadcast (plain or encoded) likewise, once per model
version and codec, for the clients granted the stage. Installing a new model drops them.

Where the broadcast is built: `GlobalModel.publish` (what the round loop calls for each
new version) builds the payload, and the encodings and frames that the grants held by
connected sessions need, in a worker thread, and only then makes the version visible to
task delivery; `GlobalModel.prepare` does the same for grants that appeared since (a
session that joined after the version was published). Building on first use
(`Broadcast.select`) is the fallback for a grant neither saw; it is thread-safe:
each encoding and frame is built once, by whichever thread asks first, and a thread
asking meanwhile waits for that build. The download codecs (fp16, bf16) are
deterministic, so the bytes do not depend on which thread built them or when.

Memory: a version's encodings are built while the round loop still holds the round's
aggregate, so the peak of a publish is the aggregate, the new payload and the encodings
and frames (fp16: half the model, and its frame), with the old version's let go.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
from collections.abc import Callable, Collection, Iterable
from typing import Generic, TypeVar

import numpy as np

from fedloom.compression import CodecSpec, CompressionError, compress, encode
from fedloom.payload import PayloadInfo, deserialize, serialize
from fedloom.server.persistence import RunPersistence
from fedloom.weights import Weights

log = logging.getLogger("fedloom.server")

#: A download grant: the codec (None: plain float32) and whether the zstd stage follows.
Grant = tuple[CodecSpec | None, bool]
#: A payload and the header that describes it (``wire_bytes`` set for a zstd frame).
Described = tuple[PayloadInfo, memoryview]

K = TypeVar("K")
V = TypeVar("V")


class _BuiltOnce(Generic[K, V]):
    """Values built at most once per key, by the first thread that asks for one; a
    thread asking while another builds that key waits for its result."""

    def __init__(self, build: Callable[[K], V]) -> None:
        self._build = build
        self._values: dict[K, V] = {}
        self._locks: dict[K, threading.Lock] = {}
        self._guard = threading.Lock()  # over _locks only: builds of two keys overlap

    def __contains__(self, key: K) -> bool:
        return key in self._values

    def get(self, key: K) -> V:
        if key in self._values:
            return self._values[key]
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            if key not in self._values:
                self._values[key] = self._build(key)
        return self._values[key]


class Broadcast:
    """One model version's broadcast: the payload its weights are views into, and the
    encoded payloads and zstd frames built from it (once each, from any thread)."""

    def __init__(self, weights: Weights, version: int) -> None:
        payload = serialize(weights)
        self.weights = deserialize(weights.specs(), payload)
        self.payload = payload
        self.info = PayloadInfo.describe(weights.specs(), payload)
        #: The round (model version) that produced these weights.
        self.version = version
        self._encoded: _BuiltOnce[CodecSpec, Described | None] = _BuiltOnce(self._encode)
        self._frames: _BuiltOnce[CodecSpec | None, Described | None] = _BuiltOnce(
            self._compress)

    def encoded(self, spec: CodecSpec) -> Described | None:
        """The model encoded with ``spec`` (a download codec); None when this model
        cannot be (fp16 and a value beyond its range): it is then sent plain, and the
        server says so once per model version."""
        return self._encoded.get(spec)

    def compressed(self, spec: CodecSpec | None) -> Described | None:
        """The broadcast encoded with ``spec`` (None: plain) as a zstd frame; None when
        the frame would not be smaller (the payload goes as it is)."""
        return self._frames.get(spec)

    def select(self, codec: CodecSpec | None, zstd: bool
               ) -> tuple[PayloadInfo, memoryview, CodecSpec | None]:
        """What a client granted ``codec`` (and ``zstd``) is sent: the payload's header,
        the payload (the zstd frame, when granted and smaller), and the codec used
        (None: plain). Builds what is missing, on the calling thread."""
        encoded = self.encoded(codec) if codec is not None else None
        used = codec if encoded is not None else None
        frame = self.compressed(used) if zstd else None
        info, payload = frame or encoded or (self.info, self.payload)
        return info, payload, used

    def ready(self, grant: Grant) -> bool:
        """Whether `select` has everything for ``grant`` built (it then builds nothing)."""
        codec, zstd = grant
        if codec is not None and codec not in self._encoded:
            return False
        used = codec if codec is not None and self._encoded.get(codec) is not None else None
        return not zstd or used in self._frames

    def prepare(self, grants: Iterable[Grant]) -> None:
        """Build everything `select` needs for ``grants`` (on the calling thread)."""
        for codec, zstd in grants:
            self.select(codec, zstd)

    def _encode(self, spec: CodecSpec) -> Described | None:
        try:
            # fp16 and bf16 are deterministic: the generator is never drawn from.
            weights = encode(spec.build(), self.weights, np.random.default_rng(0))
        except CompressionError as exc:
            log.warning("model version %d is broadcast plain to clients granted %s: %s",
                        self.version, spec, exc)
            return None
        payload = serialize(weights)
        return PayloadInfo.describe(weights.specs(), payload), payload

    def _compress(self, spec: CodecSpec | None) -> Described | None:
        encoded = self.encoded(spec) if spec is not None else None
        info, payload = encoded or (self.info, self.payload)
        frame = compress(payload)
        if frame is None:
            return None
        return dataclasses.replace(info, wire_bytes=len(frame)), memoryview(frame)


def _built(weights: Weights, version: int, grants: Collection[Grant]) -> Broadcast:
    broadcast = Broadcast(weights, version)
    broadcast.prepare(grants)
    return broadcast


class GlobalModel:
    """The current global weights and their broadcast (see the module docstring).

    Lives on the event loop: `publish` and `prepare` are awaited there and do their
    building in ``executor``; ``grants`` is called on the loop, and returns the download
    grants the connected sessions hold.
    """

    def __init__(self, persistence: RunPersistence) -> None:
        self._persistence = persistence
        self._broadcast: Broadcast | None = None
        #: The round (model version) that produced these weights (0: the initial model).
        self.version = persistence.completed_round
        self.install(persistence.weights, self.version)

    @property
    def current(self) -> Broadcast:
        """The broadcast of the installed version."""
        if self._broadcast is None:
            raise RuntimeError("the global model is being replaced: no task may be issued "
                               "until its new version is published")
        return self._broadcast

    @property
    def payload(self) -> memoryview:
        return self.current.payload

    @property
    def info(self) -> PayloadInfo:
        return self.current.info

    @property
    def num_bytes(self) -> int:
        return self.info.total_bytes

    def encoded(self, spec: CodecSpec) -> Described | None:
        """`Broadcast.encoded` of the installed version."""
        return self.current.encoded(spec)

    def compressed(self, spec: CodecSpec | None) -> Described | None:
        """`Broadcast.compressed` of the installed version."""
        return self.current.compressed(spec)

    def install(self, weights: Weights, version: int) -> None:
        """Make ``weights``, produced by round ``version``, the global model (also what
        the next commit writes), building its payload on the calling thread."""
        self._retire(weights)
        self._adopt(Broadcast(weights, version))

    async def publish(self, weights: Weights, version: int,
                      grants: Callable[[], Collection[Grant]],
                      executor: concurrent.futures.Executor, prepare: bool = True) -> None:
        """`install`, with the payload built in ``executor``, and (when ``prepare``:
        some task will carry this version) every encoding and frame the ``grants`` held
        need, those held when the build starts and those that appear while it runs.

        ``version`` becomes the model's version only once all of it is built, in the
        same step of the loop as the last check of ``grants``: task delivery, which
        reads the version, never sees this one half-built.
        """
        self._retire(weights)  # the old payload goes first: two copies at the peak
        loop = asyncio.get_running_loop()
        held = grants() if prepare else ()
        broadcast = await loop.run_in_executor(executor, _built, weights, version, held)
        if prepare:
            await _complete(broadcast, grants, executor)
        self._adopt(broadcast)

    async def prepare(self, grants: Callable[[], Collection[Grant]],
                      executor: concurrent.futures.Executor | None) -> None:
        """Build in ``executor`` (None: the loop's default executor) what the installed
        version's broadcast lacks for the ``grants`` held; returns (on the loop) when
        nothing is missing."""
        await _complete(self.current, grants, executor)

    def _retire(self, weights: Weights) -> None:
        # Nothing may be issued until _adopt: see `current`.
        self._broadcast = None
        self.weights = self._persistence.weights = weights

    def _adopt(self, broadcast: Broadcast) -> None:
        self._broadcast = broadcast
        self.version = broadcast.version
        self.weights = self._persistence.weights = broadcast.weights  # not a second copy


async def _complete(broadcast: Broadcast, grants: Callable[[], Collection[Grant]],
                    executor: concurrent.futures.Executor | None) -> None:
    """Build ``broadcast``'s missing pieces for ``grants`` in ``executor`` until a check
    on the loop finds none missing (sessions may join while a build runs)."""
    loop = asyncio.get_running_loop()
    while missing := [grant for grant in grants() if not broadcast.ready(grant)]:
        await loop.run_in_executor(executor, broadcast.prepare, missing)
