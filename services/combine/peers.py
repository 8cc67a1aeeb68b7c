"""A combine worker's peers: one channel per scatter worker and one client per segcache instance,
shared by every request, and each segcache's NIXL readiness (probed in the background).
"""

from __future__ import annotations

import asyncio
import time

import grpc
import structlog

from common.mesh.auth import read_secret
from common.mesh.channels import channel_options, open_channel
from common.mesh.segcache_client import SegcacheClient
from protos.hypic.v1 import scatter_pb2_grpc as scatter_grpc
from services.combine.config import CombineConfig

log = structlog.get_logger("combine.peers")


class PeerUnavailable(Exception):
    """A peer could not be connected to (refused, unreachable, or too slow to connect)."""


async def ensure_connected(channel: grpc.aio.Channel, timeout: float) -> None:
    """Return once `channel` is READY; fail fast when the peer refuses connections, and after
    `timeout` when it does not answer at all (a black-holed address)."""
    end = time.monotonic() + timeout
    state = channel.get_state(try_to_connect=True)
    while state != grpc.ChannelConnectivity.READY:
        if state in (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN):
            raise PeerUnavailable(f"channel {state.name.lower()}")
        rem = end - time.monotonic()
        if rem <= 0:
            raise PeerUnavailable("connect timeout")
        try:
            await asyncio.wait_for(channel.wait_for_state_change(state), rem)
        except asyncio.TimeoutError:
            raise PeerUnavailable("connect timeout") from None
        state = channel.get_state()


class Peers:
    """Channels to scatter workers and segcache clients, one per address, shared by requests."""

    def __init__(self, cfg: CombineConfig):
        self.cfg = cfg
        self._opts = channel_options(cfg.max_message_bytes)
        self._write_token = read_secret(cfg.write_token)  # sent with our segcache Puts
        self._scatter: dict[str, tuple[grpc.aio.Channel, scatter_grpc.ScatterStub]] = {}
        self._segcache: dict[str, tuple[grpc.aio.Channel, SegcacheClient]] = {}
        self._nixl: dict[str, asyncio.Future] = {}  # address -> NIXL probe (-> bool)

    def scatter(self, addr: str) -> tuple[grpc.aio.Channel, scatter_grpc.ScatterStub]:
        if addr not in self._scatter:
            ch = open_channel(addr, self._opts, self.cfg)
            self._scatter[addr] = (ch, scatter_grpc.ScatterStub(ch))
        return self._scatter[addr]

    def segcache(self, addr: str) -> tuple[grpc.aio.Channel, SegcacheClient]:
        if addr not in self._segcache:
            ch = open_channel(addr, self._opts, self.cfg)
            self._segcache[addr] = (ch, SegcacheClient(addr, channel=ch, write_token=self._write_token,
                                                       max_message_bytes=self.cfg.max_message_bytes,
                                                       timeout_s=self.cfg.segcache_timeout_s))
            if self.cfg.nixl:
                self._probe(addr)
        return self._segcache[addr]

    # ---- NIXL readiness: probed in the background, never waited for by a request ----------
    def _probe(self, addr: str) -> asyncio.Future:
        """The NIXL probe of `addr` (NixlInfo + our own agent, seconds the first time); a probe
        that failed (segcache down) is started again."""
        t = self._nixl.get(addr)
        if t is None or (t.done() and (t.cancelled() or t.exception() is not None)):
            t = asyncio.ensure_future(self._probe_once(addr))
            t.add_done_callback(lambda f: f.cancelled() or f.exception())
            self._nixl[addr] = t
        return t

    async def _probe_once(self, addr: str) -> bool:
        ok, why = await self.segcache(addr)[1].nixl_available()
        if ok:
            log.info("nixl ready", segcache=addr)
        else:
            log.info("nixl unavailable, segcache hits go over gRPC", segcache=addr, reason=why)
        return ok

    def nixl_ready(self, addr: str) -> bool:
        """Whether hits from `addr` can be read with NIXL now. Never waits: until the probe has
        answered, reads go over the gRPC stream."""
        if not self.cfg.nixl:
            return False
        t = self._probe(addr)
        return t.done() and not t.cancelled() and t.exception() is None and bool(t.result())

    async def prepare(self, addr: str, timeout: float, retry_s: float = 0.5) -> bool:
        """At startup: connect to segcache `addr` and probe its NIXL agent. Segcache may start
        alongside this worker, so a probe that fails (not serving yet) is made again every
        `retry_s`, for at most `timeout` s; after that it is made again at first use."""
        self.segcache(addr)
        if not self.cfg.nixl:
            return False
        end = time.monotonic() + timeout
        while True:
            try:
                return bool(await asyncio.wait_for(asyncio.shield(self._probe(addr)),
                                                   max(0.0, end - time.monotonic())))
            except Exception as e:
                if time.monotonic() + retry_s >= end:
                    log.warning("nixl probe failed", segcache=addr, error=f"{type(e).__name__}: {e}")
                    return False
            await asyncio.sleep(retry_s)

    def nixl_broken(self, addr: str, why: str) -> None:
        """A NIXL read said NIXL is unavailable after all: gRPC from now on for this address."""
        log.warning("nixl read unavailable, segcache hits go over gRPC", segcache=addr, reason=why)
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(False)
        self._nixl[addr] = fut

    async def close(self) -> None:
        for t in self._nixl.values():
            if not t.done():
                t.cancel()
        for ch, _ in self._scatter.values():
            await ch.close()
        for _, client in self._segcache.values():
            await client.close()  # its channel, and its NIXL agent
