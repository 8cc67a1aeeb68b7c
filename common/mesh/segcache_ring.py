"""Many segcache instances behind one client: each key lives on the instance rendezvous hashing
(highest random weight) picks among the instances this process sees healthy.

    ring = SegcacheRing("10.0.0.1:50061,10.0.0.2:50061")   # or a list; one address works too
    ring = SegcacheRing("dns:///segcache:50061")            # every A/AAAA record is a member
    infos = await ring.lookup(keys)      # one Lookup per instance, concurrent; never raises
    await ring.put(key, data, ...)       # to the key's owner
    got = await ring.get_with_info(key)  # from the key's owner

Why rendezvous: adding or removing one of N instances moves only the keys whose highest weight
was (or becomes) that instance, about 1/N of them, and every process that sees the same instance
list places a key on the same instance with no coordination.

Health is passive: an instance whose call fails with UNAVAILABLE or DEADLINE_EXCEEDED (or that
does not answer a Lookup within its budget) is left out of placement for `cooldown_s`, then tried
again; when it answers, its keys are its own again. A down or slow instance makes its keys
misses, never a failed lookup. Lives in common/ because router, scatter and combine all use it.

Members by DNS (`dns:///name:port`, `dns://server[:port]/name:port`, common/mesh/discovery.py):
the name is resolved at the first call and re-resolved every `refresh_s` seconds in the
background, like the scatter and combine pools. When a member joins or leaves, rendezvous moves
only the keys whose owner changed; their next lookup asks the new owner, which answers a miss
unless its shared tier (mooncake) holds the entry, so the entry is rebuilt and stored there.
Entries are addressed by content (the segment key), so a moved key is at worst a rebuild, never a
wrong answer. A departed member's client stays open `RETIRE_GRACE_S` for calls in flight. A name
without records is an empty ring: lookups are misses, claims are granted, Puts and Gets fail
with NoMembers (an OSError, which every caller already treats as "segcache unavailable").
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any, Callable, Iterable, Sequence

import grpc
import structlog

from common.mesh.segcache_client import SegcacheClient
from common.mesh import channels
from common.mesh.discovery import MemberSet, parse_target
from protos.hypic.v1 import segcache_pb2 as segcache_pb

log = structlog.get_logger("segcache.ring")

DEFAULT_COOLDOWN_S = 2.0
MAX_LOOKUP_KEYS = 4096  # segcache's default max_lookup_keys
# Codes that say "the instance is not there (or too slow)", as opposed to "this request is bad".
DOWN_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
RECONNECT_MAX_MS = 1000  # an instance that comes back is asked again within a second
DEFAULT_REFRESH_S = 2.0  # how often a dns: target is re-resolved (the pools' default too)
RETIRE_GRACE_S = 30.0  # a departed member's client outlives the calls started before it left


class NoMembers(ConnectionError):
    """The ring's DNS name has no records now (an OSError: callers treat it as 'unavailable')."""


def parse_addresses(spec: str | Iterable[str] | None) -> list[str]:
    """'a:1, b:2,a:1' -> ['a:1', 'b:2'] (order kept, blanks and repeats dropped)."""
    if spec is None:
        return []
    parts = spec.split(",") if isinstance(spec, str) else list(spec)
    out: list[str] = []
    for p in parts:
        p = p.strip()
        if p and p not in out:
            out.append(p)
    return out


def weight(address: str, key: str) -> int:
    """The rendezvous weight of `key` on `address`: 64 bits of blake2b over both."""
    h = hashlib.blake2b(f"{address}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big")


def owner(key: str, addresses: Sequence[str]) -> str:
    """The instance of `addresses` with the highest weight for `key` (ties: the first listed)."""
    if not addresses:
        raise ValueError("no segcache addresses")
    return max(addresses, key=lambda a: weight(a, key))


def group_by_owner(keys: Iterable[str], addresses: Sequence[str]) -> dict[str, list[str]]:
    """Keys grouped by their owner, each group in the keys' order."""
    groups: dict[str, list[str]] = {}
    for k in keys:
        groups.setdefault(owner(k, addresses), []).append(k)
    return groups


class SegcacheRing:
    """SegcacheClient's key-addressed calls over many instances (the same names and arguments)."""

    def __init__(self, addresses: str | Sequence[str], *, cooldown_s: float = DEFAULT_COOLDOWN_S,
                 channel_options: list[tuple[str, Any]] | None = None,
                 open_channel: Callable[[str], grpc.aio.Channel] | None = None,
                 refresh_s: float = DEFAULT_REFRESH_S, **client_kw: Any):
        """addresses: a static list, or one dns: target (members resolved at the first call).
        open_channel: address -> channel (TLS, the caller's options); default: an insecure
        channel with `channel_options` and a short reconnect backoff."""
        text = addresses if isinstance(addresses, str) else ",".join(addresses)
        self.dns_target = parse_target(text.strip()) if text.strip().startswith("dns:") else None
        self.addresses = [] if self.dns_target else parse_addresses(addresses)
        if not self.addresses and self.dns_target is None:
            raise ValueError("no segcache addresses")
        self.cooldown_s = cooldown_s
        if channel_options is None:
            channel_options = channels.message_options(client_kw.get("max_message_bytes", 64 << 20))
        channel_options = list(channel_options) + channels.reconnect_options(max_backoff_ms=RECONNECT_MAX_MS)
        if open_channel is None:
            def open_channel(a: str) -> grpc.aio.Channel:
                return channels.open_channel(a, channel_options)
        self._open_channel, self._client_kw = open_channel, client_kw
        self.clients: dict[str, SegcacheClient] = {a: self._new_client(a) for a in self.addresses}
        self._down_until: dict[str, float] = {}
        self._retiring: set[asyncio.Task] = set()
        self._left_at: dict[str, float] = {}  # member -> when its record went away
        self.members: MemberSet | None = None
        self._discovery: asyncio.Task | None = None
        if self.dns_target is not None:
            self.members = MemberSet(self.dns_target, refresh_s=refresh_s, listener=self.set_members,
                                     what="segcache")

    def _new_client(self, address: str) -> SegcacheClient:
        return SegcacheClient(address, channel=self._open_channel(address), **self._client_kw)

    @property
    def target(self) -> str:
        return self.dns_target.text if self.dns_target else ",".join(self.addresses)

    async def __aenter__(self) -> "SegcacheRing":
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def start(self) -> None:
        """Resolve a dns: target once and keep it current in the background (a static ring: no-op).
        Every call does this itself the first time; calling it at start-up only saves the wait."""
        if self.members is None:
            return
        if self._discovery is None:
            self._discovery = asyncio.get_running_loop().create_task(self.members.run())
        while not self.members.resolved and not self._discovery.done():
            await asyncio.sleep(0.01)  # run() resolves first, then sleeps refresh_s

    def set_members(self, members: Sequence[str]) -> None:
        """The member list now (the DNS listener): new members get a client, departed ones are
        left out of placement at once and closed after RETIRE_GRACE_S."""
        members = parse_addresses(members)
        for a in members:
            if a not in self.clients:
                self.clients[a] = self._new_client(a)
        gone = [a for a in self.addresses if a not in members]
        if gone or members != self.addresses:
            log.info("segcache members", members=members, left=gone,
                     joined=[a for a in members if a not in self.addresses])
        self.addresses = list(members)
        for a in gone:
            self._left_at[a] = time.monotonic()
            t = asyncio.get_running_loop().create_task(self._retire(a))
            self._retiring.add(t)
            t.add_done_callback(self._retiring.discard)

    async def _retire(self, address: str) -> None:
        await asyncio.sleep(RETIRE_GRACE_S)
        # Not back in the meantime, and not back and gone again (then its own task closes it).
        if (address not in self.addresses and address in self.clients
                and time.monotonic() - self._left_at.get(address, 0.0) >= RETIRE_GRACE_S):
            self._down_until.pop(address, None)
            await self.clients.pop(address).close()

    async def close(self) -> None:
        for t in [self._discovery, *self._retiring]:
            if t is not None:
                t.cancel()
        await asyncio.gather(*[t for t in [self._discovery, *self._retiring] if t is not None],
                             return_exceptions=True)
        await asyncio.gather(*(c.close() for c in self.clients.values()), return_exceptions=True)

    # ---- health --------------------------------------------------------------------------------
    def healthy(self) -> list[str]:
        """Instances in placement now; all of them when none is (better a retry than no cache)."""
        now = time.monotonic()
        up = [a for a in self.addresses if self._down_until.get(a, 0.0) <= now]
        return up or list(self.addresses)

    def mark_down(self, address: str, why: str) -> None:
        if self._down_until.get(address, 0.0) <= time.monotonic():
            log.warning("segcache instance left out of placement", segcache=address, reason=why,
                        cooldown_s=self.cooldown_s)
        self._down_until[address] = time.monotonic() + self.cooldown_s

    def _note(self, address: str, exc: BaseException) -> None:
        if isinstance(exc, grpc.aio.AioRpcError) and exc.code() in DOWN_CODES:
            self.mark_down(address, exc.code().name)
        elif isinstance(exc, (asyncio.TimeoutError, OSError)):
            self.mark_down(address, type(exc).__name__)

    def owner(self, key: str) -> str:
        up = self.healthy()
        if not up:
            raise NoMembers(f"segcache {self.target}: no members")
        return owner(key, up)

    def client_for(self, key: str) -> SegcacheClient:
        return self.clients[self.owner(key)]

    # ---- lookup: batched per instance, concurrent, failures are misses ----------------------------
    async def _lookup_one(self, address: str, keys: list[str], request_id: str | None,
                          timeout: float | None, failed: list[str]) -> list[segcache_pb.EntryInfo]:
        client = self.clients[address]
        t = client.timeout_s if timeout is None else timeout
        try:
            found: list[segcache_pb.EntryInfo] = []
            for i in range(0, len(keys), MAX_LOOKUP_KEYS):
                found += await asyncio.wait_for(client.lookup(
                    keys[i:i + MAX_LOOKUP_KEYS], request_id=request_id, timeout=t), t)
            return found
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, OSError) as e:
            self._note(address, e)
            failed.append(address)
            log.warning("segcache lookup failed; its keys are misses", segcache=address,
                        keys=len(keys), error=type(e).__name__ if not isinstance(e, grpc.aio.AioRpcError)
                        else e.code().name)
            return [segcache_pb.EntryInfo(key=k, tier=segcache_pb.TIER_MISS) for k in keys]

    async def lookup(self, keys: Sequence[str], *, request_id: str | None = None,
                     timeout: float | None = None) -> list[segcache_pb.EntryInfo]:
        """EntryInfo of every key (TIER_MISS for misses and for keys of a down or slow instance)."""
        return (await self.lookup_reporting(keys, request_id=request_id, timeout=timeout))[0]

    async def lookup_reporting(self, keys: Sequence[str], *, request_id: str | None = None,
                               timeout: float | None = None
                               ) -> tuple[list[segcache_pb.EntryInfo], list[str], list[str]]:
        """lookup(), plus the instances asked and those that failed (their keys are misses)."""
        await self.start()
        up = self.healthy()
        groups = group_by_owner(keys, up) if up else {}  # no members: every key a miss
        failed: list[str] = []
        results = await asyncio.gather(*(self._lookup_one(a, ks, request_id, timeout, failed)
                                         for a, ks in groups.items()))
        by_key = {e.key: e for r in results for e in r}
        entries = [by_key.get(k) or segcache_pb.EntryInfo(key=k, tier=segcache_pb.TIER_MISS) for k in keys]
        return entries, list(groups), failed

    # ---- build claims: batched per instance like lookups ---------------------------------------------
    async def _claim_one(self, address: str, keys: list[str], holder: str, lease_s: float,
                         request_id: str | None, timeout: float | None) -> list[segcache_pb.ClaimResult]:
        client = self.clients[address]
        t = client.timeout_s if timeout is None else timeout
        if self._down_until.get(address, 0.0) > time.monotonic():
            return [segcache_pb.ClaimResult(key=k, granted=True) for k in keys]  # do not wait on it again
        try:
            return await asyncio.wait_for(client.claim(keys, holder, lease_s, request_id=request_id,
                                                       timeout=t), t)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, OSError) as e:
            # No one to coordinate with: build (a duplicate build at worst, never a wait).
            self._note(address, e)
            return [segcache_pb.ClaimResult(key=k, granted=True) for k in keys]

    async def claim(self, keys: Sequence[str], holder: str, lease_s: float, *,
                    request_id: str | None = None, timeout: float | None = None) -> list[segcache_pb.ClaimResult]:
        """ClaimResult of every key; an instance that fails grants its keys (build them)."""
        await self.start()
        up = self.healthy()
        groups = group_by_owner(keys, up) if up else {}  # no members: build every key
        results = await asyncio.gather(*(
            self._claim_one(a, ks[i:i + MAX_LOOKUP_KEYS], holder, lease_s, request_id, timeout)
            for a, ks in groups.items() for i in range(0, len(ks), MAX_LOOKUP_KEYS)))
        by_key = {r.key: r for rs in results for r in rs}
        return [by_key.get(k) or segcache_pb.ClaimResult(key=k, granted=True) for k in keys]

    # ---- one key: its owner ------------------------------------------------------------------------
    async def _on_owner(self, key: str, method: str, *args: Any, **kw: Any) -> Any:
        await self.start()
        address = self.owner(key)
        try:
            return await getattr(self.clients[address], method)(key, *args, **kw)
        except Exception as e:
            self._note(address, e)
            raise

    async def put(self, key: str, data: Any, **kw: Any) -> segcache_pb.PutResponse:
        return await self._on_owner(key, "put", data, **kw)

    async def get_with_info(self, key: str, **kw: Any) -> tuple[segcache_pb.EntryInfo, bytearray] | None:
        return await self._on_owner(key, "get_with_info", **kw)

    async def get(self, key: str, **kw: Any) -> bytearray | None:
        return await self._on_owner(key, "get", **kw)

    async def get_via_nixl(self, key: str, **kw: Any) -> Any:
        return await self._on_owner(key, "get_via_nixl", **kw)

    # ---- many keys: grouped by owner -----------------------------------------------------------------
    async def delete(self, keys: Iterable[str], **kw: Any) -> int:
        await self.start()
        up = self.healthy()
        groups = group_by_owner(keys, up) if up else {}
        counts = await asyncio.gather(*(self.clients[a].delete(ks, **kw) for a, ks in groups.items()))
        return sum(counts)

    async def pin(self, keys: Iterable[str], pinned: bool = True, **kw: Any) -> segcache_pb.PinResponse:
        await self.start()
        keys, up = list(keys), self.healthy()
        if not up:
            return segcache_pb.PinResponse(updated=0, missing=keys)
        resps = await asyncio.gather(*(self.clients[a].pin(ks, pinned, **kw)
                                       for a, ks in group_by_owner(keys, up).items()))
        return segcache_pb.PinResponse(updated=sum(r.updated for r in resps),
                                       missing=[k for r in resps for k in r.missing])

    async def stats(self, **kw: Any) -> dict[str, segcache_pb.StatsResponse | None]:
        """Stats of every instance (None for one that did not answer)."""
        async def one(a: str) -> segcache_pb.StatsResponse | None:
            try:
                return await self.clients[a].stats(**kw)
            except (grpc.aio.AioRpcError, asyncio.TimeoutError, OSError) as e:
                self._note(a, e)
                return None
        await self.start()
        members = list(self.addresses)
        return dict(zip(members, await asyncio.gather(*(one(a) for a in members))))
