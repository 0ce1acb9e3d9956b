"""One record on a lower tier: a 4 KiB header, then one host chunk's bytes, unchanged.

The header names what the bytes are (identity fingerprint, key, rank, size) and carries the
payload's CRC-32C, so a record is checked on every read: another server's, a truncated or a
corrupted one is a miss, never loaded. The header is a whole 4 KiB page so that the payload starts
aligned and one vectored, direct read puts it straight into the host chunk.

CRC-32C comes from the ``crc32c`` package (ICRAR): hardware instructions on x86-64 and Arm
(~10 GB/s a core here), and it releases the GIL while it hashes, so the engine's thread keeps
running while an I/O thread checks a record. zlib's CRC-32 also releases the GIL but ran at
1.5 GB/s; xxhash is faster but holds the GIL for the whole buffer.
"""

from __future__ import annotations

import struct

import crc32c

from .contract import Failure

HEADER_BYTES = 4096
MAGIC = b"NPUKVREC"
_FIXED = struct.Struct("<8sIIIIQI32s")  # magic, version, rank, world, key_len, payload_bytes, crc, fingerprint
HEADER_VERSION = 1
MAX_KEY_BYTES = HEADER_BYTES - _FIXED.size - 4


class RecordError(Exception):
    """A record that must not be loaded; ``failure`` says why (corrupt or foreign)."""

    def __init__(self, failure: Failure, detail: str):
        super().__init__(detail)
        self.failure = failure


def checksum(data) -> int:
    """CRC-32C of a bytes-like object (memoryview slices of host memory included)."""
    return crc32c.crc32c(data)


def pack_header(fingerprint: str, key: bytes, rank: int, world: int, payload_bytes: int, crc: int) -> bytes:
    if len(key) > MAX_KEY_BYTES:
        raise ValueError(f"key of {len(key)} bytes; a record header holds at most {MAX_KEY_BYTES}")
    fixed = _FIXED.pack(MAGIC, HEADER_VERSION, rank, world, len(key), payload_bytes, crc, fingerprint.encode())
    body = fixed + key
    body += struct.pack("<I", checksum(body))
    return body + bytes(HEADER_BYTES - len(body))


def check_header(header, fingerprint: str, key: bytes, rank: int, world: int, payload_bytes: int) -> int:
    """The payload's CRC from a header that must describe exactly this record; else RecordError."""
    if len(header) < HEADER_BYTES:
        raise RecordError(Failure.CORRUPT, f"header of {len(header)} bytes, expected {HEADER_BYTES}")
    magic, version, h_rank, h_world, key_len, h_payload, crc, h_fp = _FIXED.unpack_from(header, 0)
    if magic != MAGIC or version != HEADER_VERSION or key_len > MAX_KEY_BYTES:
        raise RecordError(Failure.CORRUPT, f"not a record header (magic {magic!r}, version {version})")
    end = _FIXED.size + key_len
    (h_crc,) = struct.unpack_from("<I", header, end)
    if checksum(bytes(header[:end])) != h_crc:
        raise RecordError(Failure.CORRUPT, "header checksum mismatch")
    h_key = bytes(header[_FIXED.size:end])
    if h_fp.rstrip(b"\0").decode(errors="replace") != fingerprint:
        raise RecordError(Failure.FOREIGN, f"record of identity {h_fp!r}, expected {fingerprint}")
    if h_key != key or h_rank != rank or h_world != world:
        raise RecordError(Failure.FOREIGN, f"record of another key or rank ({h_rank}/{h_world})")
    if h_payload != payload_bytes:
        raise RecordError(Failure.FOREIGN, f"record of {h_payload} bytes, expected {payload_bytes}")
    return crc


__all__ = ["HEADER_BYTES", "RecordError", "check_header", "checksum", "pack_header"]
