"""LMDB values framed in place: a Put's buffer (payload_buffer) has room for the value header in
front, so encode_value writes the header there instead of copying the entry. Checked against
the copying path (the reference) on random entries, and through a real store and LMDB file."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from services.segcache.config import SegcacheConfig
from services.segcache.lmdb_file import HEADER, decode_value, encode_value, payload_buffer
from services.segcache.records import checksum
from services.segcache.store import SegmentStore

MiB = 1 << 20


def framed(rng: np.random.Generator, size: int) -> np.ndarray:
    buf = payload_buffer(size)
    buf[:] = rng.integers(0, 256, size, dtype=np.uint8)
    return buf


def test_a_framed_value_equals_the_copied_one_and_shares_the_buffer(fresh_seed: int) -> None:
    rng = np.random.default_rng(fresh_seed)
    for size in [1, 31, 32, 4095, *rng.integers(1, 3 * MiB, 6).tolist()]:
        buf = framed(rng, int(size))
        digest = checksum(buf)
        reference = bytes(encode_value(buf.copy(), digest))
        value = encode_value(buf, digest)
        assert bytes(value) == reference, size
        assert np.shares_memory(np.frombuffer(value, dtype=np.uint8), buf), size
        assert decode_value(value, size, digest).tobytes() == buf.tobytes()


def test_arrays_without_room_in_front_are_copied(fresh_seed: int) -> None:
    rng = np.random.default_rng(fresh_seed)
    buf = framed(rng, 5000)
    digest = rng.bytes(16)
    room = buf.base[:HEADER.size].tobytes()
    for arr in (buf[1:], buf[:-1], buf[::2], np.array(buf), np.frombuffer(buf.tobytes(), np.uint8)):
        value = encode_value(arr, digest)
        got = np.frombuffer(value, dtype=np.uint8)
        assert not np.shares_memory(got, buf)
        assert bytes(value[HEADER.size:]) == arr.tobytes()
        assert bytes(value[:HEADER.size]) == bytes(encode_value(arr.copy(), digest)[:HEADER.size])
    assert buf.base[:HEADER.size].tobytes() == room  # only the framed path writes there


def test_framed_entries_read_back_from_lmdb(tmp_path: Path, fresh_seed: int) -> None:
    rng = np.random.default_rng(fresh_seed)
    cfg = dict(data_dir=tmp_path / "lmdb", lmdb_sync=False, host_bytes=0, disk_bytes=64 * MiB)
    entries = {f"k{i}": framed(rng, int(rng.integers(1, 2 * MiB))) for i in range(8)}
    s = SegmentStore(SegcacheConfig(**cfg))
    try:
        for k, buf in entries.items():
            assert s.put(k, buf, expected_checksum=checksum(buf)).created
    finally:
        s.close()
    s = SegmentStore(SegcacheConfig(**cfg))  # reopened: every read comes from the file
    try:
        assert s.stats()["corrupt_dropped"] == 0
        for k, buf in entries.items():
            info, arr = s.get(k)
            assert arr.tobytes() == buf.tobytes() and info.size == len(buf), k
    finally:
        s.close()
