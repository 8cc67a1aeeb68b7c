"""Memory that Puts in progress may hold: one global budget of bytes, reserved per upload.

A Put reserves its declared size when its header arrives, before any buffer exists, and gives it
back when it ends, however it ends; a Put that does not fit is refused (RESOURCE_EXHAUSTED) rather
than allocated. Uploads that stop sending are ended by `Paced` after an idle timeout, so a stalled
client cannot keep its reservation. Without this, 20 concurrent 16 MiB Puts took segcache to
771 MiB under a 64 MiB host budget (issue 14).

Used from the event loop only (no lock).
"""
from __future__ import annotations

import asyncio
import ctypes
import gc
import time
from contextlib import contextmanager
from typing import Any, AsyncIterator, Iterator

import grpc

from common.mesh.abort import Abort
from services.segcache import metrics as m


def _libc_malloc_trim() -> Any:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_malloc_trim = _libc_malloc_trim()


class UploadBudget:
    def __init__(self, limit: int, collect_interval_s: float = 1.0):
        self.limit = int(limit)
        self.reserved = 0
        self.collect_interval_s = collect_interval_s
        self._collect_due: asyncio.TimerHandle | None = None
        self._last_collect = 0.0

    def after_failed_upload(self) -> None:
        """Collect reference cycles soon (at most once per collect_interval_s). A Put that fails
        (refused, stalled, reset, bad data) leaves its received messages and buffer in cycles
        between exceptions, frames and grpc's call objects; few Python objects are allocated
        per MiB received, so the cycle collector's own schedule left them for minutes: each
        round of 20 stalled 16 MiB Puts kept ~100 MiB more (issue 30)."""
        self._settle_soon()

    def _settle_soon(self) -> None:
        if self._collect_due is not None:
            return
        delay = max(0.0, self._last_collect + self.collect_interval_s - time.monotonic())
        self._collect_due = asyncio.get_running_loop().call_later(delay, self._collect)

    def _collect(self) -> None:
        self._collect_due = None
        self._last_collect = time.monotonic()
        gc.collect()
        if _malloc_trim is not None:
            # Free heap pages between live blocks go back to the OS: gRPC's socket reads of many
            # streams leave them scattered through malloc's arenas, which shrink only from the top.
            _malloc_trim(0)

    @contextmanager
    def reserve(self, size: int) -> Iterator[None]:
        """Hold `size` bytes for the body of the `with`; RESOURCE_EXHAUSTED when they do not fit."""
        if self.reserved + size > self.limit:
            m.REFUSED.labels("budget").inc()
            raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"uploads in progress hold {self.reserved} of {self.limit} bytes; "
                        f"no room for {size} more now, retry later")
        self.reserved += size
        try:
            yield
        finally:
            self.reserved -= size
            if self.reserved == 0:  # the last upload in progress ended: settle its leftovers
                self._settle_soon()


class Paced:
    """`messages`, ending the upload with DEADLINE_EXCEEDED when none arrives for idle_timeout_s.

    An iterator object, not an async generator: a generator suspended at `yield msg` keeps the
    message it handed over in its frame, and a refused Put's generator lives on in reference
    cycles until the collector runs (UploadBudget.after_failed_upload)."""

    def __init__(self, messages: AsyncIterator[Any], idle_timeout_s: float):
        self._it = messages.__aiter__()
        self._idle_timeout_s = idle_timeout_s

    def __aiter__(self) -> "Paced":
        return self

    async def __anext__(self) -> Any:
        try:
            return await asyncio.wait_for(self._it.__anext__(), self._idle_timeout_s)
        except asyncio.TimeoutError:
            m.REFUSED.labels("stalled").inc()
            raise Abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"upload stalled: nothing received for {self._idle_timeout_s:g} s") from None
