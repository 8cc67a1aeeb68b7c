"""Client of the segcache service (grpc.aio), with the NIXL reader side.

    async with SegcacheClient("127.0.0.1:50061") as sc:
        await sc.put(key, data, recompute_cost_s=0.8, token_count=512)
        infos = await sc.lookup([key, other])          # EntryInfo per key (tier TIER_MISS = 0)
        data = await sc.get(key)                        # bytearray, or None on a miss
        got = await sc.get_at_place(key, reader_place)  # .data, or .device: an IPC lease (same GPU)
        arr = await sc.get_via_nixl(key, out=buffer)    # numpy uint8, or None on a miss

Every call takes an optional request_id (sent as x-request-id) and a timeout. Reads verify the
checksum (common.engine.checksum) the server returns (ChecksumError on a mismatch) unless verify=False.
Lives in common/ because router, combine and scatter all talk to segcache and services must
not import each other.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import grpc
import numpy as np

from common.engine.checksum import DIGEST_BYTES, checksum  # noqa: F401  (re-exported)
from common.mesh.auth import WRITE_TOKEN_KEY
from common.mesh.channels import message_options, open_channel
from common.mesh.log import REQUEST_ID_KEY
from common.mesh.nixl_util import NixlAgent, NixlUnavailable
from protos.hypic.v1 import segcache_pb2 as segcache_pb
from protos.hypic.v1 import segcache_pb2_grpc as segcache_grpc

DEFAULT_CHUNK = 1 << 20


class ChecksumError(RuntimeError):
    """Bytes received from segcache do not match the entry's checksum."""


@dataclass
class PlacedRead:
    """A Get's answer: the bytes (`data`, the host path), or a device lease (`device`, the "ipc"
    path: segcache.proto's DeviceLease, with the IpcHandle of the entry's device buffer)."""

    info: segcache_pb.EntryInfo
    data: bytearray | None = None
    device: segcache_pb.DeviceLease | None = None


class SegcacheClient:
    def __init__(self, target: str, *, max_message_bytes: int = 64 << 20, timeout_s: float = 30.0,
                 nixl_agent_name: str | None = None, channel: grpc.aio.Channel | None = None,
                 write_token: str | None = None):
        self.target = target
        self.timeout_s = timeout_s
        self.max_message_bytes = max_message_bytes
        self._channel = channel or open_channel(target, message_options(max_message_bytes))
        self.stub = segcache_grpc.SegcacheStub(self._channel)
        self._write_token = write_token  # segcache's writer role without a writer certificate
        self._nixl_name = nixl_agent_name or f"segcache-reader-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._nixl: NixlAgent | None = None

    async def __aenter__(self) -> "SegcacheClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()
        if self._nixl is not None:
            self._nixl.close()

    def _md(self, request_id: str | None) -> list[tuple[str, str]] | None:
        return [(REQUEST_ID_KEY, request_id)] if request_id else None

    def _write_md(self, request_id: str | None) -> list[tuple[str, str]] | None:
        """Metadata of a write (Put, Delete, Pin): the request id and the write token."""
        md = (self._md(request_id) or []) + (
            [(WRITE_TOKEN_KEY, self._write_token)] if self._write_token else [])
        return md or None

    def _t(self, timeout: float | None) -> float:
        return self.timeout_s if timeout is None else timeout

    async def wait_ready(self, timeout: float = 10.0) -> None:
        await asyncio.wait_for(self._channel.channel_ready(), timeout)

    # ---- control ------------------------------------------------------------------------
    async def lookup(self, keys: Sequence[str], *, request_id: str | None = None,
                     timeout: float | None = None) -> list[segcache_pb.EntryInfo]:
        resp = await self.stub.Lookup(segcache_pb.LookupRequest(keys=list(keys)), timeout=self._t(timeout),
                                      metadata=self._md(request_id))
        return list(resp.entries)

    async def delete(self, keys: Iterable[str], *, request_id: str | None = None,
                     timeout: float | None = None) -> int:
        resp = await self.stub.Delete(segcache_pb.DeleteRequest(keys=list(keys)), timeout=self._t(timeout),
                                      metadata=self._write_md(request_id))
        return resp.deleted

    async def pin(self, keys: Iterable[str], pinned: bool = True, *, request_id: str | None = None,
                  timeout: float | None = None) -> segcache_pb.PinResponse:
        return await self.stub.Pin(segcache_pb.PinRequest(keys=list(keys), pinned=pinned),
                                   timeout=self._t(timeout), metadata=self._write_md(request_id))

    async def claim(self, keys: Sequence[str], holder: str, lease_s: float, *,
                    request_id: str | None = None, timeout: float | None = None) -> list[segcache_pb.ClaimResult]:
        """Build claims on `keys` (see ClaimRequest): granted, cached, or held by someone else."""
        resp = await self.stub.Claim(segcache_pb.ClaimRequest(keys=list(keys), holder=holder, lease_s=lease_s),
                                     timeout=self._t(timeout), metadata=self._md(request_id))
        return list(resp.results)

    async def stats(self, *, timeout: float | None = None) -> segcache_pb.StatsResponse:
        return await self.stub.Stats(segcache_pb.StatsRequest(), timeout=self._t(timeout))

    # ---- data over gRPC -------------------------------------------------------------------
    async def put(self, key: str, data: Any, *, recompute_cost_s: float = 0.0, token_count: int = 0,
                  model_fingerprint: str = "", pin: bool = False, chunk_bytes: int = DEFAULT_CHUNK,
                  send_checksum: bool = True, request_id: str | None = None,
                  timeout: float | None = None) -> segcache_pb.PutResponse:
        """Stream an entry in. Returns the PutResponse (created=False: it was already cached)."""
        mv = memoryview(data).cast("B")
        chunk_bytes = max(1, min(chunk_bytes, self.max_message_bytes - 4096))
        header = segcache_pb.PutHeader(key=key, size=len(mv), recompute_cost_s=recompute_cost_s,
                              token_count=token_count, model_fingerprint=model_fingerprint,
                              pin=pin, checksum=checksum(mv) if send_checksum else b"")

        def messages():
            first = bytes(mv[:chunk_bytes])
            yield segcache_pb.PutRequest(header=header, data=first)
            for off in range(chunk_bytes, len(mv), chunk_bytes):
                yield segcache_pb.PutRequest(data=bytes(mv[off:off + chunk_bytes]))

        return await self.stub.Put(messages(), timeout=self._t(timeout), metadata=self._write_md(request_id))

    async def get_with_info(self, key: str, *, chunk_bytes: int = 0, verify: bool = True,
                            request_id: str | None = None, timeout: float | None = None
                            ) -> tuple[segcache_pb.EntryInfo, bytearray] | None:
        got = await self._read(segcache_pb.GetRequest(key=key, chunk_bytes=chunk_bytes), verify, request_id, timeout)
        return None if got is None else (got.info, got.data)

    async def get_at_place(self, key: str, reader: segcache_pb.ReaderPlace, *, chunk_bytes: int = 0,
                           verify: bool = True, request_id: str | None = None,
                           timeout: float | None = None) -> "PlacedRead | None":
        """A Get that says where the reader is (ReaderPlace, common.mesh.transfer_path.reader_place_pb):
        segcache answers a reader on its own GPU with a device lease (`.device`: an IPC handle of
        the entry's device buffer; call release_device(lease_id) once the bytes are copied), any
        other reader with the bytes (`.data`), as get(). None on a miss. `verify` checks the bytes
        of a host answer; a device answer's bytes are the reader's to check."""
        req = segcache_pb.GetRequest(key=key, chunk_bytes=chunk_bytes, reader=reader)
        return await self._read(req, verify, request_id, timeout)

    async def release_device(self, lease_id: str, *, request_id: str | None = None,
                             timeout: float | None = None) -> bool:
        """End a device lease (False: unknown or expired already)."""
        resp = await self.stub.ReleaseDeviceLease(segcache_pb.ReleaseDeviceLeaseRequest(lease_id=lease_id),
                                                  timeout=self._t(timeout), metadata=self._md(request_id))
        return resp.released

    async def _read(self, req: segcache_pb.GetRequest, verify: bool, request_id: str | None,
                    timeout: float | None) -> "PlacedRead | None":
        key = req.key
        call = self.stub.Get(req, timeout=self._t(timeout), metadata=self._md(request_id))
        info = None
        buf = bytearray()
        n = 0
        try:
            async for msg in call:
                if info is None:
                    info = msg.entry
                    if msg.HasField("device"):  # the "ipc" answer: one message, no bytes
                        return PlacedRead(info, device=msg.device)
                    buf = bytearray(info.size)
                d = msg.data
                if n + len(d) > len(buf):
                    raise ChecksumError(f"{key}: server sent more than {len(buf)} bytes")
                buf[n:n + len(d)] = d
                n += len(d)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise
        if info is None or n != info.size:
            raise ChecksumError(f"{key}: short read ({n} bytes)")
        if verify and checksum(buf) != info.checksum:
            raise ChecksumError(f"{key}: checksum mismatch on the gRPC path")
        return PlacedRead(info, data=buf)

    async def get(self, key: str, **kw: Any) -> bytearray | None:
        """The entry's bytes over the gRPC stream, or None when it is not cached."""
        got = await self.get_with_info(key, **kw)
        return None if got is None else got[1]

    # ---- data over NIXL -------------------------------------------------------------------
    def _agent(self) -> NixlAgent:
        if self._nixl is None:
            # a reader progresses its own worker while it waits for a READ: no progress thread
            self._nixl = NixlAgent(self._nixl_name, progress_thread=False)
        if not self._nixl.available:
            raise NixlUnavailable(self._nixl.reason or "nixl unavailable")
        return self._nixl

    async def nixl_available(self) -> tuple[bool, str]:
        """Whether both ends can use NIXL, and why not."""
        info = await self.stub.NixlInfo(segcache_pb.NixlInfoRequest(), timeout=self.timeout_s)
        if not info.available:
            return False, f"server: {info.reason}"
        try:
            await asyncio.get_running_loop().run_in_executor(None, self._agent)
        except NixlUnavailable as e:
            return False, f"client: {e}"
        return True, ""

    async def _ensure_peer(self, agent: NixlAgent, peer: str) -> None:
        if agent.knows(peer):
            return
        info = await self.stub.NixlInfo(segcache_pb.NixlInfoRequest(), timeout=self.timeout_s)
        if not info.available:
            raise NixlUnavailable(f"server: {info.reason}")
        if info.agent_name != peer:
            raise NixlUnavailable(f"server agent changed ({peer} -> {info.agent_name})")
        agent.add_remote(info.agent_metadata)

    async def get_via_nixl(self, key: str, *, out: np.ndarray | None = None, verify: bool = True,
                           out_registered: bool = False, request_id: str | None = None,
                           timeout: float | None = None) -> np.ndarray | None:
        """Pull the entry straight from the server's host memory with a NIXL READ.

        out: a C-contiguous uint8 buffer of at least the entry's size to read into (reuse one
        across calls to avoid page faults); the returned array is out[:size]. None on a miss.
        Raises NixlUnavailable when either side lacks NIXL (fall back to get()).
        """
        loop = asyncio.get_running_loop()
        agent = self._nixl if self._nixl is not None and self._nixl.available else \
            await loop.run_in_executor(None, self._agent)
        md = self._md(request_id)
        try:
            lease = await self.stub.OpenNixlLease(
                segcache_pb.OpenNixlLeaseRequest(key=key, reader_agent_name=agent.name),
                timeout=self._t(timeout), metadata=md)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return None
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise NixlUnavailable(e.details()) from None
            raise
        try:
            size = lease.entry.size
            if out is None:
                dst = np.empty(size, dtype=np.uint8)
            else:
                if out.dtype != np.uint8 or out.ndim != 1 or not out.flags.c_contiguous or out.nbytes < size:
                    raise ValueError(f"out must be a contiguous 1-D uint8 array of >= {size} bytes")
                dst = out[:size]
            await self._ensure_peer(agent, lease.agent_name)
            if lease.region_metadata:
                agent.add_remote(lease.region_metadata)
            remote = [(d.addr, d.length, d.device_id) for d in lease.descriptors]
            await loop.run_in_executor(None, lambda: agent.read_into(
                dst, remote, lease.agent_name, mem_type=lease.mem_type or "DRAM",
                notif=lease.lease_id.encode(), timeout_s=self._t(timeout),
                registered=out_registered and out is not None))
        finally:
            try:
                await self.stub.ReleaseNixlLease(segcache_pb.ReleaseNixlLeaseRequest(lease_id=lease.lease_id),
                                                 timeout=self._t(timeout), metadata=md)
            except grpc.aio.AioRpcError:
                pass  # the lease expires on its own
        if verify and checksum(dst) != lease.entry.checksum:
            raise ChecksumError(f"{key}: checksum mismatch on the NIXL path")
        return dst

    def register_buffer(self, buf: np.ndarray) -> Any:
        """Register a reusable destination buffer once (then pass out_registered=True)."""
        return self._agent().register(buf)

    def deregister_buffer(self, handle: Any) -> None:
        self._agent().deregister(handle)
