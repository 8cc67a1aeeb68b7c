"""The router's downstream pools: the combine workers it sends plans to (least loaded first,
a cooldown after a failure) and the scatter workers whose load it polls for the planner."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from common.rpc.tls import open_channel
from protos.hypic.v1 import combine_pb2_grpc as cpb_grpc
from protos.hypic.v1 import scatter_pb2 as spb
from protos.hypic.v1 import scatter_pb2_grpc as spb_grpc
from services.router import metrics as m
from services.router.planner import Planner

log = structlog.get_logger("router.servicer")

# Reconnect quickly after a peer restarts (grpc's default backoff grows to 120 s). The connect
# timeout itself ("grpc.min_reconnect_backoff_ms", 20 s) stays grpc's default.
BACKOFF_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200),
                   ("grpc.max_reconnect_backoff_ms", 2000)]


@dataclass(eq=False)
class _Combine:
    address: str
    channel: grpc.aio.Channel
    stub: cpb_grpc.CombineStub
    in_flight: int = 0
    cooldown_until: float = 0.0

    def connected(self) -> bool:
        return self.channel.get_state(try_to_connect=False) == grpc.ChannelConnectivity.READY


class CombinePool:
    """Picks a combine: healthy ones first, then fewest requests in flight, round-robin on ties."""

    def __init__(self, addresses: list[str], options: list, cooldown_s: float, *, tls: Any = None):
        self.cooldown_s = cooldown_s
        self.items = []
        for a in addresses:
            ch = open_channel(a, options, tls)
            self.items.append(_Combine(a, ch, cpb_grpc.CombineStub(ch)))
        self._rr = 0

    def order(self) -> list[_Combine]:
        now = time.monotonic()
        n = len(self.items)
        self._rr = (self._rr + 1) % max(n, 1)
        ranked = sorted(range(n), key=lambda i: (self.items[i].cooldown_until > now,
                                                 self.items[i].in_flight, (i - self._rr) % n))
        return [self.items[i] for i in ranked]

    def failed(self, c: _Combine) -> None:
        c.cooldown_until = time.monotonic() + self.cooldown_s

    async def close(self) -> None:
        for c in self.items:
            await c.channel.close()


class ScatterPool:
    """Scatter.Load polls: external load and up/down state for the planner."""

    def __init__(self, addresses: list[str], options: list, planner: Planner, fingerprint: str,
                 timeout_s: float, *, tls: Any = None):
        self.addresses = addresses
        self.planner = planner
        self.fingerprint = fingerprint
        self.timeout_s = timeout_s
        self.channels = [open_channel(a, options, tls) for a in addresses]
        self.stubs = [spb_grpc.ScatterStub(ch) for ch in self.channels]
        self._warned: set[int] = set()

    async def poll_once(self) -> None:
        async def one(w: int) -> None:
            try:
                r = await self.stubs[w].Load(spb.LoadRequest(), timeout=self.timeout_s)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    self.planner.mark_down(w, False)  # an older worker: no Load, still usable
                    return
                if not self.planner.is_down(w):
                    log.warning("scatter worker not answering", worker=self.addresses[w],
                                code=e.code().name)
                self.planner.mark_down(w, True)
                m.WORKER_UP.labels(self.addresses[w]).set(0)
                return
            if r.model_fingerprint and self.fingerprint and r.model_fingerprint != self.fingerprint:
                if w not in self._warned:
                    self._warned.add(w)
                    log.error("scatter worker serves another model; not assigning to it",
                              worker=self.addresses[w], theirs=r.model_fingerprint,
                              ours=self.fingerprint)
                self.planner.mark_down(w, True)
                m.WORKER_UP.labels(self.addresses[w]).set(0)
                return
            if self.planner.is_down(w):
                log.info("scatter worker back", worker=self.addresses[w])
            self.planner.mark_down(w, False)
            self.planner.set_external_load(w, r.in_flight, r.queued_tokens)
            m.WORKER_UP.labels(self.addresses[w]).set(1)

        await asyncio.gather(*(one(w) for w in range(len(self.stubs))))

    async def run(self, period_s: float) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception:  # never let the poller die
                log.exception("scatter load poll failed")
            await asyncio.sleep(period_s)

    async def close(self) -> None:
        for ch in self.channels:
            await ch.close()
