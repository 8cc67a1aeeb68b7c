"""Sealed entries: a segment entry's identity bound to its bytes, checked at every use.

An entry's bytes (whatever `SegmentEntry.to_bytes` writes) name what the entry is in their header:
model fingerprint, token ids, seam, dtype, layer layout. The entry's own checksum covers only
its tensors, so a rewritten header, or a payload moved under another header, parsed as a sound
entry of another segment: cache poisoning. The seal closes that:

    sealed = entry_bytes || b"HYPS" || tag        tag = HMAC-SHA256(secret, "hypic-entry-v1\0" || entry_bytes)

- the tag covers every byte of the entry, header and tensors (and whatever trailer the entry
  format itself grows: the seal is outside it);
- `open_sealed(sealed, key, secret)` checks the tag, then re-derives the segment key from what the
  header says and compares it with the key the entry is used under. Any failure raises
  ForgedEntry; the caller treats it as a miss, drops the entry and counts it.

With a secret (the `entry_key_file` of scatter, combine and segcache, the same for the whole mesh)
nobody without it can make an entry that opens. Without one the tag is an HMAC under the empty key,
in effect a digest: header and tensors still cannot be separated by accident, but a writer who can
reach segcache can forge them. HMAC-SHA256 rather than keyed blake2b: OpenSSL's SHA-256 (SHA-NI)
measured 2-4x faster than hashlib's blake2b over 16 MiB here, and entries are hashed at every use.

Pure Python (no torch): segcache checks Puts with it.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import struct
from pathlib import Path
from typing import Any

import structlog

from common.fingerprint import segment_key

SEAL_MAGIC = b"HYPS"
TAG_BYTES = 32
TRAILER_BYTES = len(SEAL_MAGIC) + TAG_BYTES
ENTRY_MAGIC = b"HYPE"  # common/pic/entry.py's; repeated here so that this module stays torch-free
MAX_HEADER_BYTES = 64 << 20
_DOMAIN = b"hypic-entry-v1\0"  # a tag for entries and nothing else


class ForgedEntry(ValueError):
    """Sealed bytes that do not open: no or a wrong tag, an unreadable header, or a header that
    names another segment than the key it is used under."""


_warned: set[str] = set()


def warn_no_key(consequence: str) -> None:
    """Say once per process (per consequence) that this service has no entry key file."""
    if consequence not in _warned:
        _warned.add(consequence)
        structlog.get_logger("seal").warning(
            "no entry key file: entries are not protected against forgery; give every service "
            "of the mesh the same --entry-key-file (hypic up does)", consequence=consequence)


def load_secret(path: str | Path | None) -> bytes:
    """The entry secret from a file (surrounding whitespace stripped); b"" when no path is given
    (with a warning, once: entries are then sealed under the empty key, which anyone can do)."""
    if not path:
        warn_no_key("entries are sealed and checked under the empty key: anyone who can write "
                    "to segcache can forge them")
        return b""
    secret = Path(path).read_bytes().strip()
    if not secret:
        raise ValueError(f"entry key file {path} is empty")
    return secret


def _tag(entry: Any, secret: bytes) -> bytes:
    mac = hmac.new(secret, _DOMAIN, hashlib.sha256)
    mac.update(entry)
    return mac.digest()


def seal(entry: bytes, secret: bytes) -> bytes:
    """`entry` with its tag appended."""
    return b"".join((entry, SEAL_MAGIC, _tag(entry, secret)))  # one copy of the entry


def header_of(entry: Any) -> dict[str, Any]:
    """The JSON header of entry bytes (ForgedEntry when there is none)."""
    mv = memoryview(entry)
    if len(mv) < 8 or bytes(mv[:4]) != ENTRY_MAGIC:
        raise ForgedEntry("not a segment entry (bad magic)")
    (n,) = struct.unpack("<I", mv[4:8])
    if n > min(MAX_HEADER_BYTES, len(mv) - 8):
        raise ForgedEntry("entry header length out of range")
    try:
        header = json.loads(bytes(mv[8:8 + n]))
    except ValueError:
        raise ForgedEntry("entry header is not JSON") from None
    if not isinstance(header, dict):
        raise ForgedEntry("entry header is not an object")
    return header


def identity_key(header: dict[str, Any]) -> str:
    """The segment key of what an entry header says it is."""
    try:
        ids = header["token_ids"]
        seam, fp, dtype = header["seam"], header["fingerprint"], header["dtype"]
        if not (isinstance(ids, list) and all(isinstance(t, int) and 0 <= t < 2**32 for t in ids)
                and isinstance(seam, int) and 0 <= seam < 2**31 and isinstance(fp, str)
                and isinstance(dtype, str)):
            raise ForgedEntry("entry header fields have the wrong types")
        return segment_key(fp, seam, dtype, ids)
    except (KeyError, TypeError, struct.error):
        raise ForgedEntry("entry header lacks its identity fields") from None


def open_sealed(sealed: Any, key: str, secret: bytes) -> memoryview:
    """The entry bytes inside `sealed`, when its tag is right and its header names the segment
    `key` addresses; ForgedEntry otherwise (saying which)."""
    mv = memoryview(sealed).cast("B")
    if len(mv) <= TRAILER_BYTES or bytes(mv[-TRAILER_BYTES:-TAG_BYTES]) != SEAL_MAGIC:
        raise ForgedEntry("entry is not sealed")
    entry, tag = mv[:-TRAILER_BYTES], bytes(mv[-TAG_BYTES:])
    if not hmac.compare_digest(_tag(entry, secret), tag):
        raise ForgedEntry("entry seal does not match its bytes (forged, damaged, or another mesh's key)")
    if identity_key(header_of(entry)) != key:
        raise ForgedEntry("entry header names another segment than its key")
    return entry
