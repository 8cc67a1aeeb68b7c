"""segcache's fixed HTTP/2 stream window (--stream-window-bytes): what the server announces on a
real connection, read byte by byte, and that Puts whose messages are far larger than the window
still arrive whole. The memory it bounds is measured in test_untrusted_input.py."""
from __future__ import annotations

import asyncio
import struct

import numpy as np
import pytest

from common.mesh.segcache_client import SegcacheClient
from services.segcache.__main__ import stream_window_options
from services.segcache.config import SegcacheConfig
from tests.support.raw_traffic import PREFACE, SETTINGS, exchange, frame
from tests.support.segcache_process import arun

pytestmark = pytest.mark.timeout(180)
KiB, MiB = 1 << 10, 1 << 20
INITIAL_WINDOW_SIZE = 0x4  # RFC 9113 6.5.2
GRPC_AUTOMATIC_START = 4 * MiB  # common.mesh.channels.message_options' lookahead for 2 MiB messages


def announced_settings(answer: bytes) -> dict[int, int]:
    """The settings of every non-ACK SETTINGS frame the server sent, later ones winning."""
    out: dict[int, int] = {}
    at = 0
    while at + 9 <= len(answer):
        length = int.from_bytes(answer[at:at + 3], "big")
        kind, flags = answer[at + 3], answer[at + 4]
        payload = answer[at + 9:at + 9 + length]
        if kind == SETTINGS and not flags & 0x1:
            for i in range(0, len(payload) - 5, 6):
                ident, value = struct.unpack(">HI", payload[i:i + 6])
                out[ident] = value
        at += 9 + length
    return out


@pytest.mark.processes
@pytest.mark.parametrize("window, announced", [("64KiB", 64 * KiB), ("1MiB", MiB),
                                               ("0", GRPC_AUTOMATIC_START)])
def test_the_server_announces_the_configured_stream_window(launch, window: str, announced: int) -> None:
    srv = launch("--no-nixl", "--no-lmdb-sync", "--host-bytes", "16MiB", "--disk-bytes", "64MiB",
                 "--stream-window-bytes", window)
    answer = exchange("127.0.0.1", srv.port, PREFACE + frame(SETTINGS, 0, 0, b""), quiet_s=1.0)
    assert announced_settings(answer).get(INITIAL_WINDOW_SIZE) == announced


@pytest.mark.processes
def test_puts_far_larger_than_the_window_arrive_whole(launch, fresh_seed: int) -> None:
    """gRPC opens a stream's window as far as the message being read needs, so 1 MiB messages
    pass a 16 KiB window; several at once, into one server."""
    srv = launch("--no-nixl", "--no-lmdb-sync", "--host-bytes", "64MiB", "--disk-bytes", "256MiB",
                 "--stream-window-bytes", "16KiB")
    rng = np.random.default_rng(fresh_seed)
    blobs = {f"k{i}": rng.bytes(int(rng.integers(1, 6 * MiB))) for i in range(6)}

    async def run():
        async with SegcacheClient(srv.target) as c:
            got = await asyncio.gather(*(c.put(k, v) for k, v in blobs.items()))
            assert all(r.created for r in got)
            for k, v in blobs.items():
                assert bytes(await c.get(k)) == v, k
    arun(run())


def test_the_window_option_turns_bdp_probing_off_and_zero_leaves_grpc_alone() -> None:
    assert stream_window_options(0) == []
    opts = dict(stream_window_options(256 * KiB))
    # With BDP probing on, grpc-core resizes the window to at least 4 MiB whatever was asked.
    assert opts == {"grpc.http2.bdp_probe": 0, "grpc.http2.lookahead_bytes": 256 * KiB}
    for bad in (-1, 1 << 31):
        with pytest.raises(ValueError, match="stream_window_bytes"):
            SegcacheConfig(stream_window_bytes=bad)
