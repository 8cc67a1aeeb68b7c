"""The hypic.v1.Segcache gRPC servicer (grpc.aio) over a SegmentStore and a LeaseManager."""

from __future__ import annotations

import asyncio
import functools
import math
import time
import traceback
from concurrent.futures import Executor
from typing import Any, Callable

import grpc
import numpy as np
import structlog

from common.engine.pic.seal import ForgedEntry, load_secret, open_sealed, warn_no_key
from common.mesh.abort import Abort
from common.mesh.checks import stream_chunk
from common.mesh.guard import internal_details
from common.mesh.nixl_util import NixlUnavailable
from common.mesh.transfer_path import ipc_to_pb
from protos.hypic.v1 import segcache_pb2 as segcache_pb
from protos.hypic.v1 import segcache_pb2_grpc as segcache_grpc
from services.segcache import metrics as m
from services.segcache.config import SegcacheConfig
from services.segcache.device_reads import READS, DeviceLeaseTable, DeviceReads
from services.segcache.nixl_agent import LeaseManager
from services.segcache.uploads import Paced, UploadBudget
from services.segcache.claims import MAX_HOLDER_BYTES, MAX_LEASE_S, ClaimTable
from services.segcache.lmdb_file import payload_buffer
from services.segcache.remote_tier import MooncakeTier
from services.segcache.store import EntryInfo, SegcacheError, SegmentStore, check_entry_size, check_key

log = structlog.get_logger("segcache.servicer")

SERVICE_NAME = "hypic.v1.Segcache"
# How long NixlInfo / OpenNixlLease wait at most for a NIXL agent still being made in the
# background (LeaseManager.start_agent; about a second of CPU, longer on a loaded machine).
AGENT_WAIT_S = 30.0


def entry_pb(info: EntryInfo) -> segcache_pb.EntryInfo:
    return segcache_pb.EntryInfo(key=info.key, tier=info.tier, size=info.size,
                        recompute_cost_s=info.recompute_cost_s, token_count=info.token_count,
                        model_fingerprint=info.model_fingerprint, checksum=info.checksum,
                        pinned=info.pinned)


def _status(exc: SegcacheError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, exc.code, grpc.StatusCode.INTERNAL)


class SegcacheServicer(segcache_grpc.SegcacheServicer):
    remote: MooncakeTier | None = None  # the shared tier below LMDB (--remote-url), set by main
    def __init__(self, cfg: SegcacheConfig, store: SegmentStore, leases: LeaseManager,
                 executor: Executor):
        self.cfg = cfg
        self.store = store
        self.leases = leases
        self.executor = executor
        self.uploads = UploadBudget(cfg.upload_budget)
        # With the mesh's entry secret, only entries that open under it are stored (seal.py).
        self.secret = load_secret(cfg.entry_key_file) if cfg.entry_key_file else None
        if self.secret is None:
            warn_no_key("Puts are stored without checking their seal")
        self.claims = ClaimTable()
        # the same-GPU path of a Get that says where its reader is (device_reads.py)
        self.device_reads = DeviceReads(store)
        self.device_leases = DeviceLeaseTable(self.device_reads, cfg.lease_ttl_s)

    # ---- helpers ----------------------------------------------------------------------------
    async def _io(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """Run a blocking store call on the I/O threads; store errors become Abort."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self.executor, functools.partial(fn, *args, **kw))
        except SegcacheError as e:
            raise Abort(_status(e), str(e)) from None

    def _key(self, key: str) -> str:
        try:
            return check_key(key, self.cfg.max_key_bytes)
        except SegcacheError as e:
            raise Abort(_status(e), str(e)) from None

    def _keys(self, keys: Any) -> list[str]:
        keys = list(keys)
        if not keys:
            raise Abort.invalid("no keys given")
        if len(keys) > self.cfg.max_lookup_keys:
            raise Abort.invalid(f"{len(keys)} keys; at most {self.cfg.max_lookup_keys} per call")
        return [self._key(k) for k in keys]

    async def _check_entry(self, key: str, buf: np.ndarray) -> None:
        """INVALID_ARGUMENT unless `buf` is a sealed entry for `key` (when a secret is set)."""
        if self.secret is None:
            return
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self.executor, open_sealed, buf, key, self.secret)
        except ForgedEntry as e:
            m.REFUSED.labels("forged").inc()
            log.warning("refused a Put that is not a sealed entry for its key", key=key, reason=str(e))
            raise Abort.invalid(f"not a sealed entry for key {key[:16]}: {e}") from None
    async def _remote_exists(self, keys: list[str]) -> set[str]:
        if self.remote is None or not keys or not self.remote.available:
            return set()
        return await asyncio.get_running_loop().run_in_executor(self.executor, self.remote.exists, keys)

    def _promote(self, key: str) -> Any:
        """A local miss read from the shared tier (verified there), stored into the local tiers."""
        entry = self.remote.get(key)
        if entry is None:
            return None
        self.store.put(key, entry.data, recompute_cost_s=entry.recompute_cost_s,
                       token_count=entry.token_count, model_fingerprint=entry.model_fingerprint,
                       expected_checksum=entry.checksum)
        return self.store.get(key)

    @staticmethod
    async def _fail(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
        if isinstance(exc, Abort):
            await exc.send(context)
        log.exception("internal error", error=f"{type(exc).__name__}: {exc}")
        await context.abort(grpc.StatusCode.INTERNAL, internal_details())

    # ---- RPCs -------------------------------------------------------------------------------
    async def Lookup(self, request: segcache_pb.LookupRequest, context) -> segcache_pb.LookupResponse:
        try:
            keys = self._keys(request.keys)
            infos = self.store.lookup(keys)
            remote = await self._remote_exists([k for k, i in zip(keys, infos) if i is None])
        except Exception as e:
            await self._fail(context, e)
        # In the shared tier only: a hit of unknown size (Get reads and promotes it).
        infos = [segcache_pb.EntryInfo(key=k, tier=segcache_pb.TIER_REMOTE) if i is None and k in remote else i
                 for k, i in zip(keys, infos)]
        return segcache_pb.LookupResponse(entries=[
            i if isinstance(i, segcache_pb.EntryInfo) else entry_pb(i) if i is not None
            else segcache_pb.EntryInfo(key=k, tier=segcache_pb.TIER_MISS) for k, i in zip(keys, infos)])

    def _check_header(self, header: segcache_pb.PutHeader) -> None:
        self._key(header.key)
        if header.size == 0:
            raise Abort.invalid("entry size must be > 0")
        if not (math.isfinite(header.recompute_cost_s) and header.recompute_cost_s >= 0):
            raise Abort.invalid("recompute_cost_s must be a finite number >= 0")
        try:
            check_entry_size(header.size, self.cfg)
        except SegcacheError as e:
            raise Abort(_status(e), str(e)) from None

    @staticmethod
    def _take(buf: np.ndarray, n: int, data: bytes) -> int:
        """Copy one message's `data` into buf at n; the new fill."""
        if n + len(data) > len(buf):
            raise Abort.invalid(f"more than the declared {len(buf)} bytes")
        buf[n:n + len(data)] = np.frombuffer(data, dtype=np.uint8)
        return n + len(data)

    async def _receive(self, buf: np.ndarray, n: int, rest: Any) -> None:
        """Fill buf (its first n bytes already there) from the rest of the stream."""
        async for msg in rest:
            if msg.HasField("header"):
                raise Abort.invalid("header sent twice in one Put")
            n = self._take(buf, n, msg.data)
            del msg  # not held across the next wait
        if n != len(buf):
            raise Abort.invalid(f"stream ended after {n} of {len(buf)} declared bytes")

    @staticmethod
    def _header_of(first: segcache_pb.PutRequest | None) -> segcache_pb.PutHeader:
        if first is None:
            raise Abort.invalid("empty Put stream")
        if not first.HasField("header"):
            raise Abort.invalid("the first Put message must carry the header")
        header = segcache_pb.PutHeader()
        header.CopyFrom(first.header)  # a view would keep the whole first message alive
        return header

    def _after_failure(self, exc: BaseException) -> None:
        """Let go of a failed Put's bytes now: the exception's frames hold its received
        messages and buffer, in reference cycles with grpc's call objects that only the
        collector breaks (UploadBudget.after_failed_upload, within a second)."""
        traceback.clear_frames(exc.__traceback__)
        self.uploads.after_failed_upload()

    async def Put(self, request_iterator, context) -> segcache_pb.PutResponse:
        first = buf = None
        try:
            messages = Paced(request_iterator, self.cfg.upload_idle_timeout_s)
            first = await anext(messages, None)
            header = self._header_of(first)
            self._check_header(header)
            with self.uploads.reserve(header.size):  # before any buffer exists
                # numpy, not bytearray: large numpy buffers are hugepage-advised, which
                # makes NIXL (UCX cma) reads of the host tier 2-3x faster. Room for LMDB's
                # value header in front spares the commit a copy of the entry.
                buf = payload_buffer(header.size)
                n = self._take(buf, 0, first.data)
                first = None  # only buf holds its bytes while the rest arrives
                await self._receive(buf, n, messages)
                await self._check_entry(header.key, buf)
                res = await self._io(self.store.put, header.key, buf,
                                     recompute_cost_s=header.recompute_cost_s,
                                     token_count=header.token_count,
                                     model_fingerprint=header.model_fingerprint, pin=header.pin,
                                     expected_checksum=header.checksum)
        except asyncio.CancelledError as e:  # the client reset the stream or hung up
            first = buf = None
            self._after_failure(e)
            raise
        except Exception as e:
            first = buf = None
            self._after_failure(e)
            await self._fail(context, e)
        self.claims.release(header.key)
        if self.remote is not None and res.created:  # write-behind; a full queue drops it
            self.remote.enqueue(header.key, buf, recompute_cost_s=header.recompute_cost_s,
                                token_count=header.token_count,
                                model_fingerprint=header.model_fingerprint, digest=res.info.checksum)
        log.debug("put", key=header.key, size=header.size, created=res.created)
        return segcache_pb.PutResponse(entry=entry_pb(res.info), created=res.created)

    async def _device_answer(self, key: str, reader: segcache_pb.ReaderPlace) -> segcache_pb.GetResponse | None:
        """The "ipc" answer to a Get from a reader on this segcache's GPU, holding a device lease
        until ReleaseDeviceLease or its TTL; None: stream the bytes (every other case)."""
        served = await self._io(self.device_reads.serve_get, key, reader, self.secret is not None)
        if served is None:
            return None
        lease_id = self.device_leases.open(served)
        # the lease ends by itself one TTL later unless released first (as NIXL leases do)
        asyncio.get_running_loop().call_later(self.cfg.lease_ttl_s, self.device_leases.expire)
        READS.labels("ipc").inc()
        return segcache_pb.GetResponse(entry=entry_pb(served.info), device=segcache_pb.DeviceLease(
            lease_id=lease_id, ipc=ipc_to_pb(served.ipc), ttl_s=self.cfg.lease_ttl_s))

    async def ReleaseDeviceLease(self, request: segcache_pb.ReleaseDeviceLeaseRequest,
                                 context) -> segcache_pb.ReleaseDeviceLeaseResponse:
        released = await self._io(self.device_leases.release, request.lease_id)
        return segcache_pb.ReleaseDeviceLeaseResponse(released=released)

    async def Get(self, request: segcache_pb.GetRequest, context):
        try:
            key = self._key(request.key)
            if request.HasField("reader"):
                answer = await self._device_answer(key, request.reader)
                if answer is not None:
                    yield answer
                    return
            got = await self._io(self.store.get, key)
            promoted = False
            if got is None and self.remote is not None:
                got = await self._io(self._promote, key)
                promoted = got is not None
            if got is None:
                raise Abort(grpc.StatusCode.NOT_FOUND, f"not cached: {key}")
        except Exception as e:
            await self._fail(context, e)
        info, arr = got
        READS.labels("host").inc()
        chunk = stream_chunk(request.chunk_bytes, self.cfg.chunk_bytes, self.cfg.max_message_bytes)
        first = True
        for off in range(0, info.size, chunk):
            data = arr[off:off + chunk].tobytes()
            if first:
                entry = entry_pb(info)
                if promoted:  # say where it came from (it lives locally from now on)
                    entry.tier = segcache_pb.TIER_REMOTE
                yield segcache_pb.GetResponse(entry=entry, data=data)
                first = False
            else:
                yield segcache_pb.GetResponse(data=data)

    async def Delete(self, request: segcache_pb.DeleteRequest, context) -> segcache_pb.DeleteResponse:
        try:
            n = await self._io(self.store.delete, self._keys(request.keys))
        except Exception as e:
            await self._fail(context, e)
        return segcache_pb.DeleteResponse(deleted=n)

    async def Pin(self, request: segcache_pb.PinRequest, context) -> segcache_pb.PinResponse:
        try:
            updated, missing = await self._io(self.store.pin, self._keys(request.keys), request.pinned)
        except Exception as e:
            await self._fail(context, e)
        return segcache_pb.PinResponse(updated=updated, missing=missing)

    async def Stats(self, request: segcache_pb.StatsRequest, context) -> segcache_pb.StatsResponse:
        s = self.store.stats()
        tiers = [segcache_pb.TierStats(tier=t["tier"], enabled=t["enabled"], budget_bytes=t["budget_bytes"],
                              bytes=t["bytes"], peak_bytes=t["peak_bytes"], entries=t["entries"],
                              hits=t["hits"], misses=t["misses"], evictions=t["evictions"],
                              promotions=t["promotions"],
                              formats=[segcache_pb.FormatStats(format=fmt, bytes=b, entries=n)
                                       for (tier, fmt), (b, n) in sorted(s["formats"].items()) if tier == t["name"]])
                 for t in s["tiers"]]
        return segcache_pb.StatsResponse(tiers=tiers, entries=s["entries"], pinned=s["pinned"],
                                corrupt_dropped=s["corrupt_dropped"], policy=s["policy"],
                                nixl_available=self.leases.available,
                                nixl_reason=self.leases.reason,
                                leases_active=self.leases.active)

    async def _wait_for_agent(self, context) -> None:
        """An agent still being made (segcache serves before it exists): wait for it within the
        call's deadline, else UNAVAILABLE, which the combine's probe retries."""
        if not self.leases.starting:
            return
        remaining = context.time_remaining()
        end = time.monotonic() + (AGENT_WAIT_S if remaining is None
                                  else min(AGENT_WAIT_S, remaining - 0.25))
        while self.leases.starting and time.monotonic() < end:
            await asyncio.sleep(0.02)
        if self.leases.starting:
            raise Abort(grpc.StatusCode.UNAVAILABLE, "the NIXL agent is still starting; try again")

    async def NixlInfo(self, request: segcache_pb.NixlInfoRequest, context) -> segcache_pb.NixlInfoResponse:
        try:
            await self._wait_for_agent(context)
        except Exception as e:
            await self._fail(context, e)
        i = self.leases.info()
        return segcache_pb.NixlInfoResponse(available=i["available"], reason=i["reason"],
                                   agent_name=i["agent_name"], agent_metadata=i["metadata"],
                                   backend=i["backend"])

    async def OpenNixlLease(self, request: segcache_pb.OpenNixlLeaseRequest, context) -> segcache_pb.OpenNixlLeaseResponse:
        try:
            key = self._key(request.key)
            await self._wait_for_agent(context)
            if not self.leases.available:
                raise Abort(grpc.StatusCode.FAILED_PRECONDITION,
                            f"NIXL unavailable on this server: {self.leases.reason}")
            try:
                lease = await self._io(self.leases.open, key, request.reader_agent_name)
            except NixlUnavailable as e:
                raise Abort(grpc.StatusCode.FAILED_PRECONDITION, f"NIXL unavailable: {e}") from None
            if lease is None:
                raise Abort(grpc.StatusCode.NOT_FOUND, f"not cached: {key}")
        except Exception as e:
            await self._fail(context, e)
        return segcache_pb.OpenNixlLeaseResponse(
            lease_id=lease.lease_id, entry=entry_pb(lease.info), agent_name=self.leases.agent.name,
            mem_type=lease.mem_type, ttl_s=self.leases.ttl_s,
            region_metadata=lease.region_metadata,
            descriptors=[segcache_pb.NixlDescriptor(addr=a, length=n, device_id=d)
                         for a, n, d in lease.descriptors])

    async def ReleaseNixlLease(self, request: segcache_pb.ReleaseNixlLeaseRequest, context) -> segcache_pb.ReleaseNixlLeaseResponse:
        released = await self._io(self.leases.release, request.lease_id)
        return segcache_pb.ReleaseNixlLeaseResponse(released=released)

    async def Claim(self, request: segcache_pb.ClaimRequest, context) -> segcache_pb.ClaimResponse:
        try:
            keys = self._keys(request.keys)
            holder = request.holder
            if not holder or len(holder.encode()) > MAX_HOLDER_BYTES:
                raise Abort.invalid(f"holder must be 1..{MAX_HOLDER_BYTES} bytes")
            if not (math.isfinite(request.lease_s) and 0 < request.lease_s <= MAX_LEASE_S):
                raise Abort.invalid(f"lease_s must be in (0, {MAX_LEASE_S:g}]")
            infos = self.store.lookup(keys)
        except Exception as e:
            await self._fail(context, e)
        self.claims.expire()
        results = [self.claims.claim(k, holder, request.lease_s, cached=i is not None)
                   for k, i in zip(keys, infos)]
        return segcache_pb.ClaimResponse(results=[
            segcache_pb.ClaimResult(key=r.key, granted=r.granted, cached=r.cached, holder=r.holder,
                           expires_in_s=r.expires_in_s) for r in results])
