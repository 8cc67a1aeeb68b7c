"""The router's downstream pools: the combine workers it sends plans to (least loaded first,
a cooldown after a failure) and the scatter workers whose load it polls for the planner."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from common.mesh.channels import open_channel
from protos.hypic.v1 import combine_pb2_grpc as combine_grpc
from protos.hypic.v1 import scatter_pb2 as scatter_pb
from protos.hypic.v1 import scatter_pb2_grpc as scatter_grpc
from services.router import metrics as m
from services.router.planner import Planner

log = structlog.get_logger("router.servicer")


@dataclass(eq=False)
class _Combine:
    address: str
    channel: grpc.aio.Channel
    stub: combine_grpc.CombineStub
    in_flight: int = 0
    cooldown_until: float = 0.0

    def connected(self) -> bool:
        return self.channel.get_state(try_to_connect=False) == grpc.ChannelConnectivity.READY


class CombinePool:
    """Picks a combine: healthy ones first, then fewest requests in flight, round-robin on ties.
    The member list follows discovery (apply); a member that leaves is closed once idle."""

    def __init__(self, addresses: list[str], options: list, cooldown_s: float, *, tls: Any = None):
        self.cooldown_s = cooldown_s
        self.tls = tls  # a config with the TLS fields (common.mesh.tls), or None: plaintext
        self.options = options
        self.items: list[_Combine] = []
        self._leaving: list[_Combine] = []
        self._rr = 0
        self.apply(addresses)

    @property
    def addresses(self) -> list[str]:
        return [c.address for c in self.items]

    def apply(self, addresses: list[str]) -> None:
        """The live member set: new addresses get a channel, vanished ones leave the order."""
        have = {c.address: c for c in self.items}
        items = []
        for a in dict.fromkeys(addresses):
            c = have.pop(a, None)
            if c is None:
                ch = open_channel(a, self.options, self.tls)
                c = _Combine(a, ch, combine_grpc.CombineStub(ch))
            items.append(c)
        self.items = items
        self._leaving.extend(have.values())
        self._close_idle()

    def _close_idle(self) -> None:
        for c in [c for c in self._leaving if c.in_flight == 0]:
            self._leaving.remove(c)
            asyncio.ensure_future(c.channel.close())

    def order(self) -> list[_Combine]:
        now = time.monotonic()
        n = len(self.items)
        self._rr = (self._rr + 1) % max(n, 1)
        ranked = sorted(range(n), key=lambda i: (self.items[i].cooldown_until > now,
                                                 self.items[i].in_flight, (i - self._rr) % n))
        return [self.items[i] for i in ranked]

    def failed(self, c: _Combine) -> None:
        c.cooldown_until = time.monotonic() + self.cooldown_s

    def done(self, c: _Combine) -> None:
        """A call on `c` ended (closes a leaving member's channel once nothing uses it)."""
        c.in_flight -= 1
        if c in self._leaving:
            self._close_idle()

    async def close(self) -> None:
        for c in self.items + self._leaving:
            await c.channel.close()


class ScatterPool:
    """The scatter members (discovery) mapped onto planner indices, and their Scatter.Load
    polls: external load and up/down state for the planner.

    `addresses[w]` is planner worker w. A member that leaves keeps its index (plans in flight
    name it) but is never assigned again; a new member reuses an idle vacated index, else gets
    a new one."""

    def __init__(self, addresses: list[str], options: list, planner: Planner, fingerprint: str,
                 timeout_s: float, *, tls: Any = None):
        self.tls = tls
        self.addresses: list[str] = []
        self.planner = planner
        self.fingerprint = fingerprint
        self.timeout_s = timeout_s
        self.options = options
        self.stubs: dict[int, scatter_grpc.ScatterStub] = {}
        self.channels: dict[int, grpc.aio.Channel] = {}
        self._warned: set[str] = set()
        self.apply(addresses)

    def present_slots(self) -> list[int]:
        """Planner indices of the current members."""
        return [w for w in range(len(self.addresses)) if not self.planner.is_absent(w)]

    @property
    def members(self) -> list[str]:
        return [self.addresses[w] for w in self.present_slots()]

    def apply(self, members: list[str]) -> None:
        live = set(members)
        for w, a in enumerate(self.addresses):
            if a not in live and not self.planner.is_absent(w):
                log.info("scatter worker left", worker=a)
                self.planner.set_absent(w, True)
                self._drop_channel(w)
                m.WORKER_UP.labels(a).set(0)
        present = set(self.members)
        for a in members:
            if a in present:
                continue
            w = self._slot_for(a)
            self.planner.set_absent(w, False)
            ch = open_channel(a, self.options, self.tls)
            self.channels[w] = ch
            self.stubs[w] = scatter_grpc.ScatterStub(ch)
            present.add(a)
            log.info("scatter worker joined", worker=a, index=w)

    def _slot_for(self, address: str) -> int:
        for w, a in enumerate(self.addresses):  # the same member back, or an idle vacated index
            if a == address and self.planner.is_absent(w):
                return w
        for w, a in enumerate(self.addresses):
            if self.planner.is_absent(w) and self.planner.idle(w) and a not in self.members:
                self.addresses[w] = address
                return w
        w = self.planner.add_worker()
        self.addresses.append(address)
        return w

    def _drop_channel(self, w: int) -> None:
        self.stubs.pop(w, None)
        ch = self.channels.pop(w, None)
        if ch is not None:
            asyncio.ensure_future(ch.close())

    async def poll_once(self) -> None:
        async def one(w: int, stub: scatter_grpc.ScatterStub) -> None:
            address = self.addresses[w]
            try:
                r = await stub.Load(scatter_pb.LoadRequest(), timeout=self.timeout_s)
            except grpc.aio.AioRpcError as e:
                if self.stubs.get(w) is not stub:
                    return  # left while we asked
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    self.planner.mark_down(w, False)  # an older worker: no Load, still usable
                    return
                if not self.planner.is_down(w):
                    log.warning("scatter worker not answering", worker=address,
                                code=e.code().name)
                self.planner.mark_down(w, True)
                m.WORKER_UP.labels(address).set(0)
                return
            if self.stubs.get(w) is not stub:
                return
            if r.model_fingerprint and self.fingerprint and r.model_fingerprint != self.fingerprint:
                if address not in self._warned:
                    self._warned.add(address)
                    log.error("scatter worker serves another model; not assigning to it",
                              worker=address, theirs=r.model_fingerprint,
                              ours=self.fingerprint)
                self.planner.mark_down(w, True)
                m.WORKER_UP.labels(address).set(0)
                return
            if self.planner.is_down(w):
                log.info("scatter worker back", worker=address)
            self.planner.mark_down(w, False)
            self.planner.set_external_load(w, r.in_flight, r.queued_tokens)
            m.WORKER_UP.labels(address).set(1)

        await asyncio.gather(*(one(w, s) for w, s in list(self.stubs.items())))

    async def run(self, period_s: float) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception:  # never let the poller die
                log.exception("scatter load poll failed")
            await asyncio.sleep(period_s)

    async def close(self) -> None:
        for ch in list(self.channels.values()):
            await ch.close()
