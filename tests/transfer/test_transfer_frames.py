"""Hand-built chunk frames are byte-for-byte what protobuf would send."""

from __future__ import annotations

import pytest

from fedloom.payload import iter_chunk_views, iter_chunks
from fedloom.protos import codec
from fedloom.protos.fedloom.v1 import fleet_pb2 as pb

OFFSETS = [0, 1, 127, 128, 300, 16_383, 16_384, 1 << 20, (1 << 40) + 7, (1 << 64) - 1]
SIZES = [1, 127, 128, 16_384, (1 << 20) + 3]


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("size", SIZES)
def test_chunk_frame_equals_protobuf(offset: int, size: int) -> None:
    data = bytes((i * 7) % 251 for i in range(size))
    want_pull = pb.PullResponse(chunk=pb.Chunk(offset=offset, data=data)).SerializeToString()
    want_push = pb.PushRequest(chunk=pb.Chunk(offset=offset, data=data)).SerializeToString()
    assert want_pull == want_push  # same field numbers: one frame serves both
    assert codec.chunk_frame(offset, data) == want_pull
    assert codec.chunk_frame(offset, memoryview(data)) == want_pull
    parsed = pb.PushRequest.FromString(codec.chunk_frame(offset, data))
    assert codec.chunk_from_proto(parsed.chunk) == (offset, data)


def test_serialize_message_passes_frames_and_serializes_messages() -> None:
    frame = codec.chunk_frame(5, b"abc")
    assert codec.serialize_message(frame) is frame
    header = pb.PushRequest(chunk=pb.Chunk(offset=5, data=b"abc"))
    assert codec.serialize_message(header) == frame


def test_chunk_views_are_the_chunks_without_copies() -> None:
    payload = bytes(range(256)) * 41
    views = list(iter_chunk_views(payload, 1000))
    assert [(o, bytes(v)) for o, v in views] == list(iter_chunks(payload, 1000))
    assert all(isinstance(v, memoryview) and v.obj is payload for _, v in views)
    with pytest.raises(ValueError):
        list(iter_chunk_views(payload, 0))
