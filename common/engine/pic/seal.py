"""Sealed entries: a segment entry's identity bound to its bytes, checked at every use.

An entry's bytes (whatever `SegmentEntry.to_bytes` writes) name what the entry is in their header:
model fingerprint, token ids, seam, dtype, layer layout. The entry's own checksum covers only
its tensors, so a rewritten header, or a payload moved under another header, parsed as a sound
entry of another segment: cache poisoning. The seal closes that:

    sealed = entry_bytes || b"HYP2" || nonce || tag
    nonce  = 16 random bytes, drawn for every seal
    tag    = Poly1305(k, entry_bytes)        k = HMAC-SHA256(secret, "hypic-entry-v2\0" || nonce)

- the tag covers every byte of the entry, header and tensors (and whatever trailer the entry
  format itself grows: the seal is outside it); it is the entry's one check on the hit path;
- Poly1305 is a one-time MAC: each seal's key k is fresh (a PRF of the secret and a random
  nonce), so a tag tells nothing about another seal's key, and without the secret no key, hence
  no tag, can be made (the Wegman-Carter construction of NaCl's secretbox and of TLS's
  ChaCha20-Poly1305). Poly1305 measured 12.8 GB/s here against HMAC-SHA256's 1.8 GB/s (OpenSSL,
  SHA-NI) over a 10 MiB entry: entries are checked at every use, at memory speed now;
- `open_sealed(sealed, key, secret)` checks the tag, then re-derives the segment key from what the
  header says and compares it with the key the entry is used under. Any failure raises
  ForgedEntry; the caller treats it as a miss, drops the entry and counts it. Entries sealed
  before (b"HYPS" || HMAC-SHA256(secret, "hypic-entry-v1\0" || entry_bytes)) still open.

With a secret (the `entry_key_file` of scatter, combine and segcache, the same for the whole mesh)
nobody without it can make an entry that opens. Without one the tags are keyed by the empty
secret, in effect a digest: header and tensors still cannot be separated by accident, but a
writer who can reach segcache can forge them.

Pure Python (no torch): segcache checks Puts with it.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import struct
from pathlib import Path
from typing import Any

import structlog
from cryptography.hazmat.primitives.poly1305 import Poly1305

from common.engine.fingerprint import segment_key

SEAL_MAGIC = b"HYP2"  # what seal() writes: Poly1305 under a per-seal key
NONCE_BYTES = 16
TAG_BYTES = 16
TRAILER_BYTES = len(SEAL_MAGIC) + NONCE_BYTES + TAG_BYTES
V1_MAGIC, V1_TAG_BYTES = b"HYPS", 32  # sealed before: HMAC-SHA256 of the entry (still opened)
V1_TRAILER_BYTES = len(V1_MAGIC) + V1_TAG_BYTES
ENTRY_MAGIC = b"HYPE"  # common/engine/pic/entry.py's; repeated here so that this module stays torch-free
MAX_HEADER_BYTES = 64 << 20
_DOMAIN = b"hypic-entry-v2\0"  # one-time keys for entries and nothing else
_V1_DOMAIN = b"hypic-entry-v1\0"


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


def _tag(entry: Any, secret: bytes, nonce: bytes) -> bytes:
    key = hmac.new(secret, _DOMAIN + nonce, hashlib.sha256).digest()  # fresh for every seal
    mac = Poly1305(key)
    mac.update(entry)
    return mac.finalize()


def _v1_tag(entry: Any, secret: bytes) -> bytes:
    mac = hmac.new(secret, _V1_DOMAIN, hashlib.sha256)
    mac.update(entry)
    return mac.digest()


def seal(entry: bytes, secret: bytes) -> bytes:
    """`entry` with a fresh nonce and its tag appended."""
    nonce = os.urandom(NONCE_BYTES)
    return b"".join((entry, SEAL_MAGIC, nonce, _tag(entry, secret, nonce)))  # one copy of the entry


def _check_tag(mv: memoryview, secret: bytes) -> memoryview:
    """The entry bytes of a sealed buffer whose tag is right; ForgedEntry otherwise."""
    if len(mv) > TRAILER_BYTES and bytes(mv[-TRAILER_BYTES:-TRAILER_BYTES + len(SEAL_MAGIC)]) == SEAL_MAGIC:
        entry, nonce, tag = mv[:-TRAILER_BYTES], bytes(mv[-TAG_BYTES - NONCE_BYTES:-TAG_BYTES]), bytes(mv[-TAG_BYTES:])
        good = hmac.compare_digest(_tag(entry, secret, nonce), tag)
    elif len(mv) > V1_TRAILER_BYTES and bytes(mv[-V1_TRAILER_BYTES:-V1_TAG_BYTES]) == V1_MAGIC:
        entry, tag = mv[:-V1_TRAILER_BYTES], bytes(mv[-V1_TAG_BYTES:])
        good = hmac.compare_digest(_v1_tag(entry, secret), tag)
    else:
        raise ForgedEntry("entry is not sealed")
    if not good:
        raise ForgedEntry("entry seal does not match its bytes (forged, damaged, or another mesh's key)")
    return entry


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
    entry = _check_tag(memoryview(sealed).cast("B"), secret)
    if identity_key(header_of(entry)) != key:
        raise ForgedEntry("entry header names another segment than its key")
    return entry
