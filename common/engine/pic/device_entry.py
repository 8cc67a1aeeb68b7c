"""Parsing a sealed entry whose bytes already live in device memory (the "ipc" read of segcache,
issue 25): no host round trip for the tensors.

    entry = entry_from_device(buf, key)    # buf: 1-D uint8 tensor on any device

SegmentEntry.from_bytes (the reference) views a host buffer; this views a device one: only the
entry's JSON header, the payload's safetensors header and the seal trailer (a few KiB at most)
are copied to the host to be read; every tensor is a slice of `buf` viewed in its dtype (copied
on the device only when misaligned), then decoded on the device (compact.decode) as from_bytes
does on the host (fp8 keys and values widened to the model dtype there too). The two agree byte for byte (tests/engine/pic/test_device_entry.py, on random
entries of every format, with a CPU tensor standing in for the device buffer).

What is checked: the seal trailer is present, the header names the segment `key` addresses, the
version and format are known and the payload's layout fits the buffer. What is NOT checked here:
the seal's tag and the entry digest, which cover every byte and can only be computed on the host.
A reader takes this path only for bytes whose seal segcache checked itself when they were Put
(ReaderPlace.requires_sealed in segcache.proto), and from a holder on its own box and GPU.
Version-1 entries (digest in the header) are refused (EntryError): their readers go the host way.
"""
from __future__ import annotations

import json
import math
import struct

import torch

from common.engine.checksum import DIGEST_BYTES
from common.engine.pic.entry import DIGEST_VERSIONS, MAGIC, ST_DTYPES, EntryError, SegmentEntry, _layer, header_format
from common.engine.pic.seal import SEAL_MAGIC, TRAILER_BYTES, V1_MAGIC, V1_TAG_BYTES, V1_TRAILER_BYTES, \
    ForgedEntry, header_of, identity_key

MAX_HEADER_BYTES = 16 << 20  # a JSON header (entry or payload) read to the host: a bound, not a size


def _host(buf: torch.Tensor, start: int, end: int) -> bytes:
    """buf[start:end] on the host (only ever headers and trailers: small)."""
    return bytes(buf[start:end].cpu().numpy().tobytes())


def _trailer_bytes(buf: torch.Tensor) -> int:
    """The length of the seal trailer at the end of `buf`; ForgedEntry when it is not sealed."""
    n = buf.numel()
    tail = _host(buf, max(0, n - max(TRAILER_BYTES, V1_TRAILER_BYTES)), n)
    if n > TRAILER_BYTES and tail[-TRAILER_BYTES:-TRAILER_BYTES + len(SEAL_MAGIC)] == SEAL_MAGIC:
        return TRAILER_BYTES
    if n > V1_TRAILER_BYTES and tail[-V1_TRAILER_BYTES:-V1_TAG_BYTES] == V1_MAGIC:
        return V1_TRAILER_BYTES
    raise ForgedEntry("entry is not sealed")


def _view(buf: torch.Tensor, offset: int, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """buf[offset:offset+nbytes] as a tensor of `dtype` and `shape`, on buf's device."""
    item = torch.empty((), dtype=dtype).element_size()
    numel = math.prod(shape)
    raw = buf[offset:offset + numel * item]
    if numel == 0:
        return torch.empty(shape, dtype=dtype, device=buf.device)
    if (buf.storage_offset() + offset) % item:
        raw = raw.clone()  # misaligned: a copy on the device (a fresh allocation is aligned)
    return raw.view(dtype).view(shape)


def view_device_safetensors(payload: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors buffer in device memory, as views of it; EntryError on any
    inconsistency (the checks of entry._view_safetensors)."""
    size = payload.numel()
    if size < 8:
        raise EntryError("truncated payload")
    (n,) = struct.unpack("<Q", _host(payload, 0, 8))
    if n > min(size - 8, MAX_HEADER_BYTES):
        raise EntryError("truncated payload header")
    try:
        meta = json.loads(_host(payload, 8, 8 + n))
    except ValueError as e:
        raise EntryError(f"corrupted payload header: {e}") from None
    base, room = 8 + n, size - 8 - n
    out = {}
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (a, b) = ST_DTYPES[info["dtype"]], [int(d) for d in info["shape"]], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise EntryError(f"bad payload header for tensor {name!r}") from None
        item = torch.empty((), dtype=dtype).element_size()
        if not (0 <= a <= b <= room and b - a == math.prod(shape) * item):
            raise EntryError(f"tensor {name!r} does not fit the payload")
        out[name] = _view(payload, base + a, shape, dtype)
    return out


def entry_from_device(buf: torch.Tensor, key: str) -> SegmentEntry:
    """The sealed entry in `buf` (1-D uint8, on any device) for segment `key`, its tensors on
    buf's device. ForgedEntry: not sealed, or its header names another segment; EntryError:
    anything malformed, or a version this parse does not read (see the module docstring)."""
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise EntryError(f"entry bytes must be a 1-D uint8 tensor, got {buf.dtype} {tuple(buf.shape)}")
    entry = buf[:buf.numel() - _trailer_bytes(buf)]
    if entry.numel() < 8 or _host(entry, 0, 4) != MAGIC:
        raise EntryError("not a segment entry (bad magic)")
    (n,) = struct.unpack("<I", _host(entry, 4, 8))
    if n > min(MAX_HEADER_BYTES, entry.numel() - 8):
        raise EntryError("entry header length out of range")
    head = _host(entry, 0, 8 + n)
    header = header_of(head)
    if identity_key(header) != key:
        raise ForgedEntry("entry header names another segment than its key")
    version, fmt, lowrank, kv = header_format(header)
    if version not in DIGEST_VERSIONS:
        raise EntryError(f"entry format version {version}: read on the host")
    if entry.numel() < 8 + n + DIGEST_BYTES:
        raise EntryError("truncated entry")
    tensors = view_device_safetensors(entry[8 + n:entry.numel() - DIGEST_BYTES])
    try:
        layers = [_layer(tensors, i, kind, buf.device, fmt, i in lowrank, kv, header["dtype"])
                  for i, kind in enumerate(header["layers"])]
        return SegmentEntry(header["token_ids"], header["seam"], header["fingerprint"], header["dtype"], layers, fmt)
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise EntryError(f"malformed entry header: {e!r}") from None
