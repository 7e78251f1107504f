"""Canonical, unambiguous byte encodings for key derivation, AAD and digests.

Every field is length-prefixed (strings and bytes) or fixed-width (integers, floats),
so two different tuples of fields never encode to the same bytes: the HKDF ``info``
and the AEAD associated data cannot be confused across runs, rounds, attempts or
client pairs.
"""

from __future__ import annotations

import struct

#: Every derivation, seal, commitment, signature and digest is bound to the protocol
#: version: v4 signs keys and survivor sets and binds the model (v3 expanded masks with
#: AES-128-CTR, v2 with AES-256-CTR, v1 with ChaCha20), so parties of different versions
#: refuse each other instead of mixing masks.
PROTOCOL_LABEL = b"fedloom/secagg/v4/"


def pack(*fields: str | bytes | int | float) -> bytes:
    """Encode fields as ``tag || length/width || value`` and concatenate them.

    Tags keep types apart (the string ``"1"`` never encodes like the integer ``1``).
    Integers must fit in a signed 64-bit word.
    """
    out = bytearray()
    for field in fields:
        if isinstance(field, bool):
            raise TypeError("pack: booleans are not a field type; use an int")
        if isinstance(field, str):
            data = field.encode("utf-8")
            out += b"s" + struct.pack(">I", len(data)) + data
        elif isinstance(field, bytes | bytearray | memoryview):
            data = bytes(field)
            out += b"b" + struct.pack(">I", len(data)) + data
        elif isinstance(field, int):
            out += b"i" + struct.pack(">q", field)
        elif isinstance(field, float):
            out += b"f" + struct.pack(">d", field)
        else:
            raise TypeError(f"pack: unsupported field type {type(field).__name__}")
    return bytes(out)
