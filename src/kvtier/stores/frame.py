"""The bytes a store keeps for one block: a versioned header, then the payload. The header repeats
the key's layout and digest and carries a checksum over header and payload, so a torn, truncated,
corrupted or misplaced value is detected and read as a miss, never as KV.

Layout (little-endian): magic `KVTB`, frame version u16, layout version u16, dtype length u16,
reserved u16, block size u32, group u32, payload length u64, key digest 16 bytes, checksum u64
(xxh3-64 of everything before it, the dtype and the payload); then the dtype name (ASCII); then
the payload.
"""

from __future__ import annotations

import struct

import xxhash

from kvtier.stores.keys import StoreKey

MAGIC = b"KVTB"
FRAME_VERSION = 1
_HEAD = struct.Struct("<4sHHHHIIQ16s")
_CHECKSUM = struct.Struct("<Q")
HEADER_BYTES = _HEAD.size + _CHECKSUM.size  # before the dtype name


class CorruptFrame(ValueError):
    """Stored bytes that are not a whole, intact frame of the key asked for."""


def _checksum(head: bytes, dtype: bytes, payload: bytes | memoryview) -> int:
    h = xxhash.xxh3_64()
    h.update(head)
    h.update(dtype)
    h.update(payload)
    return h.intdigest()


def encode_frame(key: StoreKey, payload: bytes | memoryview) -> bytes:
    """The frame of `payload` stored under `key` (a new bytes object)."""
    lay = key.layout
    dtype = lay.dtype.encode("ascii")
    head = _HEAD.pack(
        MAGIC,
        FRAME_VERSION,
        lay.layout_version,
        len(dtype),
        0,
        lay.block_size,
        key.group,
        len(payload),
        key.digest(),
    )
    return b"".join((head, _CHECKSUM.pack(_checksum(head, dtype, payload)), dtype, payload))


def frame_size(key: StoreKey, num_payload_bytes: int) -> int:
    """Bytes `encode_frame` produces for a payload of `num_payload_bytes`."""
    return HEADER_BYTES + len(key.layout.dtype) + num_payload_bytes


def decode_frame(key: StoreKey, data: bytes) -> bytes:
    """The payload of `data` read under `key`; raises CorruptFrame (naming what is wrong) when the
    frame is short, of another version or layout, stored under another key, or fails its
    checksum."""
    if len(data) < HEADER_BYTES:
        raise CorruptFrame(f"{len(data)} bytes is shorter than a frame header")
    head = data[: _HEAD.size]
    magic, version, layout_version, dtype_len, _, block_size, group, length, digest = _HEAD.unpack(
        head
    )
    if magic != MAGIC:
        raise CorruptFrame("bad magic")
    if version != FRAME_VERSION:
        raise CorruptFrame(f"frame version {version}, expected {FRAME_VERSION}")
    lay = key.layout
    found = (layout_version, block_size, group, digest)
    if found != (lay.layout_version, lay.block_size, key.group, key.digest()):
        raise CorruptFrame("frame of another layout, group or key")
    start = HEADER_BYTES + dtype_len
    if len(data) != start + length:
        raise CorruptFrame(f"{len(data)} bytes, header says {start + length}")
    dtype = data[HEADER_BYTES:start]
    if dtype != lay.dtype.encode("ascii"):
        raise CorruptFrame(f"dtype {dtype!r}, expected {lay.dtype!r}")
    payload = memoryview(data)[start:]
    (checksum,) = _CHECKSUM.unpack_from(data, _HEAD.size)
    if checksum != _checksum(head, dtype, payload):
        raise CorruptFrame("checksum mismatch")
    return bytes(payload)
