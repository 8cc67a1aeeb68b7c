"""A damaged LMDB file at start-up: found before LMDB maps it, moved aside, never deleted.

LMDB maps data.mdb and trusts it: a file truncated below the last page its meta page names kills
the process with SIGBUS on first touch, with no log line (issue 14). So before opening, the two
meta pages are read with plain file I/O: magic and version, and the file must reach the last page
the newer meta names. A file that fails, or an environment LMDB itself refuses (or whose index
cannot be read), is renamed to `<data_dir>.damaged-<UTC time>` with one clear error log line, and
the store opens empty in its place.

LMDB's on-disk meta page (lmdb 0.9, 64-bit): a 16-byte page header, then MDB_meta: magic u32,
version u32, address, mapsize, two 48-byte MDB_db records, last_pg u64, txnid u64.
"""
from __future__ import annotations

import struct
import time
from pathlib import Path

import structlog

log = structlog.get_logger("segcache.store")

PAGE_BYTES = 4096  # LMDB's page size is the OS page size
MAGIC, VERSION = 0xBEEFC0DE, 1
_MAGIC_AT, _LAST_PG_AT = 16, 136  # offsets in a meta page


def damage(data_dir: Path) -> str | None:
    """Why `data_dir`'s data.mdb cannot be mapped safely, or None (also when there is none yet)."""
    path = Path(data_dir) / "data.mdb"
    if not path.exists():
        return None
    size = path.stat().st_size
    if size == 0:
        return None  # created but never written: LMDB initialises it
    if size < 2 * PAGE_BYTES:
        return f"data.mdb is {size} bytes, shorter than its two meta pages"
    with open(path, "rb") as f:
        head = f.read(2 * PAGE_BYTES)
    metas = []
    for page in (0, PAGE_BYTES):
        magic, version = struct.unpack_from("<II", head, page + _MAGIC_AT)
        last_pg, txnid = struct.unpack_from("<QQ", head, page + _LAST_PG_AT)
        if magic == MAGIC and version == VERSION:
            metas.append((txnid, last_pg))
    if not metas:
        return "data.mdb has no valid LMDB meta page"
    _, last_pg = max(metas)
    need = (last_pg + 1) * PAGE_BYTES
    if size < need:
        return f"data.mdb is truncated: {size} bytes, its meta page names {need}"
    return None


def move_aside(data_dir: Path, reason: str) -> Path:
    """Rename `data_dir` out of the way (kept for inspection) and log it once; returns the new path."""
    data_dir = Path(data_dir)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = data_dir.with_name(f"{data_dir.name}.damaged-{stamp}")
    n = 1
    while aside.exists():
        aside = data_dir.with_name(f"{data_dir.name}.damaged-{stamp}-{n}")
        n += 1
    data_dir.rename(aside)
    log.error("segment store damaged at start; moved aside, starting empty", data_dir=str(data_dir),
              moved_to=str(aside), reason=reason)
    return aside
